"""The linear seam (nanomega/seams.py): every matmul of a weight, forward and backward, in every
layout goes through the op table's `linear` entry, so FP8 (or any number format) swaps one entry.

Each layout (tp2 + sequence parallel, pp2, cp2, ep2 with experts, ZeRO-3; 2 ranks) is built as
compose.build builds it; its `linear` entry is replaced by a counter, F.linear itself made to raise (a
module that skipped the table would call it), and one forward/backward of 2 micro-batches run:
    tracked     calls under autograd: one per weight-bearing linear module and micro-batch, and as
                many backwards through the counter (dX = dY W, dW = dY^T X)
    untracked   calls inside tp's sequence-parallel gather-linear (its own autograd Function):
                forward X W^T, backward dY W and dY^T X: 3 per such module and micro-batch
A linear that bypassed the entry would leave a count short (or raise). Then the entry is made to
return zeros: every logit is 0 and the loss is ln V, so the LM head's matmul went through it too.
"""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from nanomega import compose, cp, dist, fused, moe, recompute, seams, tp, train, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.job import checks, flags

REAL = F.linear
SHAPE = [
    "--n-layer",
    "2",
    "--n-head",
    "4",
    "--n-embd",
    "32",
    "--block-size",
    "16",
    "--dropout",
    "0",
    "--batch-size",
    "2",
    "--grad-accum",
    "2",
]
LAYOUTS = {
    "tp2-sp": ["--tp", "2", "--sequence-parallel"],
    "pp2": ["--pp", "2"],
    "cp2": ["--cp", "2"],
    "ep2": ["--arch", "llama", "--n-experts", "4", "--ep", "2", "--shared-experts", "1"],
    "zero3": ["--zero", "3"],
}


class Counted(torch.autograd.Function):
    """F.linear whose backward (dX = dY W, dW = dY^T X, db = sum dY) is counted."""

    @staticmethod
    def forward(ctx, x, weight, bias, counts):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.has_bias = counts, bias is not None
        return REAL(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        ctx.counts["backward"] += 1
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad @ weight, grad.flatten(0, -2).t() @ x.flatten(0, -2), grad_b, None


def counting(counts):
    def linear(x, weight, bias=None):
        if torch.is_grad_enabled():
            counts["tracked"] += 1
            return Counted.apply(x, weight, bias, counts)
        counts["untracked"] += 1
        return REAL(x, weight, bias)

    return linear


def zeros(x, weight, bias=None):
    return REAL(x, weight, bias) * 0


def linears(model):
    """(weight-bearing linear modules this rank holds, those of them that gather the sequence)."""
    kinds = (
        seams.Linear,
        tp.ColumnParallelLinear,
        tp.RowParallelLinear,
        tp.GroupKeyValue,
        moe.MoE,
    )  # an MoE: its router's matmul (the router is a parameter holder, called in MoE.forward)
    found = [m for m in model.modules() if isinstance(m, kinds)]
    gathers = [
        m
        for m in found
        if isinstance(m, (tp.ColumnParallelLinear, tp.GroupKeyValue)) and m.sequence_parallel
    ]
    return found, gathers


def _layout(extra):
    config = dataclasses.replace(checks.check(flags.parse([*SHAPE, *extra])), vocab_size=256)
    cfg = flags.model_config(config)
    grid = dist.Grid(config.dp, config.pp, config.tp, cp=config.cp, ep=config.ep)
    model, engine, _ = compose.build(config, grid)
    g = torch.Generator().manual_seed(grid.dp_rank)
    batches = []
    for _ in range(config.grad_accum):
        x = torch.randint(
            0, cfg.vocab_size, (config.batch_size, config.block_size + 1), generator=g
        )
        batches.append(tuple(t.to(grid.device) for t in cp.split((x[:, :-1], x[:, 1:]), grid.cp)))
    found, gathers = linears(model)
    counts = dict(tracked=0, backward=0, untracked=0)
    model.replace_op("linear", counting(counts))
    F.linear = lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("a matmul bypassed the linear entry")
    )
    try:
        loss = train.forward_backward(model, engine, grid, batches, config)
        model.replace_op("linear", zeros)
        zero_loss = train.forward_backward(model, engine, grid, batches, config)
    finally:
        F.linear = REAL
    m = len(batches)
    return dict(
        counts=counts,
        modules=len(found),
        gathers=len(gathers),
        m=m,
        loss=float(loss),
        zero_loss=float(zero_loss),
        vocab=cfg.vocab_size,
        table=model.ops_table(),
    )


# what the built model's table names for each layout (GPT.ops_table), besides the linear entry
REPLACED = {
    "tp2-sp": "tp_loss.vocab_parallel_cross_entropy",
    "cp2": "cp.core",
    "ep2": "modern.swiglu",
}


def _layouts():
    return {name: _layout(extra) for name, extra in LAYOUTS.items()}


@pytest.fixture(scope="module")
def layouts():
    """Every layout's counts, one after another in one world of 2 (one world's start, not five)."""
    return worlds.launch(_layouts, 2, timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_weight_matmul_goes_through_the_linear_entry(layouts, name):
    for rank, r in enumerate(rank_results[name] for rank_results in layouts):
        c, m, n, sp = r["counts"], r["m"], r["modules"], r["gathers"]
        assert n > 0 and "test_linear_seam.zeros" in r["table"], r["table"]  # the last entry
        assert REPLACED.get(name, "model.sdpa_core") in r["table"], r["table"]
        assert c["tracked"] == (n - sp) * m, (rank, c, n, sp)
        assert c["backward"] == c["tracked"], (
            rank,
            c,
        )  # each tracked matmul's backward: through it
        assert c["untracked"] == 3 * sp * m, (rank, c, sp)
        assert (sp > 0) == (name == "tp2-sp")
        assert abs(r["zero_loss"] - r["loss"]) > 1e-3
        assert r["zero_loss"] == pytest.approx(math.log(r["vocab"]), abs=1e-5)


def test_the_table_names_what_each_technique_replaced():
    """Recompute and the fused kernels replace entries through GPT.replace_op, and ops_table shows
    them; an entry name that does not exist is an error, not a new entry."""
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=3, n_head=2, n_embd=32))
    recompute.apply_recompute(model, "selective", 2)
    table = model.ops_table()
    assert "blocks 0-1   core       recompute.Checkpointed(model.eager_core)" in table, table
    assert "blocks 2     core       model.eager_core" in table, table
    recompute.apply_recompute(model, "none")
    assert "Checkpointed" not in model.ops_table()
    model.replace_op("softmax", fused.causal_softmax)
    assert (
        "fused.causal_softmax" in model.ops_table()
        and "model.causal_softmax" not in model.ops_table()
    )
    with pytest.raises(ValueError, match="no op 'linaer'"):
        model.replace_op("linaer", F.linear)
