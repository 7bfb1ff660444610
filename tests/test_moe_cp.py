"""Experts with context parallelism: cp 2, and cp 2 x ep 2 (dp 2), against the one-process MoE model.

Claims (spawned worlds of 1 rank (the reference), 2 (cp 2 and the plant) and 4 (cp 2 x ep 2)):
    routing   the expert loads of every layer at every step are equal exactly (integer counts)
    losses    losses, the Switch aux loss (non-zero: --moe-aux-loss 0.01 reaches the gradients),
              every gradient after step 1 and every weight after STEPS AdamW steps, within
              tolerance.layout_rtol (cp changes only the order of sums)
    planted   the same cp 2 run with the balance loss's counts not summed over cp (each rank's f its
              own chunks'): its aux loss misses the bound, so the comparison above can fail
    bytes     the cp axis's fp32 all-reduces = formulas.moe_cp_balance_bytes: one (b, E) count
              all-reduce per MoE layer and micro-batch forward (the ring's K/V travel point to point)
Tolerance: layout_rtol with V = 256, width 64, depth 9 (test_moe's), STEPS steps; a gradient or weight
relative to its tensor's largest element (test_cp's measure).
"""

import dataclasses

import pytest
import torch

from nanomega import compose, cp, dist, formulas, moe, train, worlds
from nanomega.job import flags
from tolerance import layout_rtol

import test_moe

STEPS, GLOBAL, SEQ = test_moe.STEPS, test_moe.GLOBAL, test_moe.SEQ
RTOL = layout_rtol(STEPS, vocab=test_moe.VOCAB, width=64, depth=9)
ARGV = test_moe.BASE  # dropless, mixtral router, aux loss 0.01, no weight decay
# (name, dp, cp, ep, batch-size, grad-accum)
LAYOUTS = [("cp2", 1, 2, 1, 4, 2), ("dp2-cp2-ep2", 2, 2, 2, 2, 2)]


def err(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(dp, cp_, ep, b, accum, unreduced=False):
    """STEPS steps of one layout on this rank: losses, aux, loads, step 1's gradients and the last
    weights (by name, this rank's), the cp bytes of the first step."""
    argv = ARGV + ["--cp", str(cp_), "--ep", str(ep), "--batch-size", str(b)]
    config = flags.parse(argv + ["--grad-accum", str(accum), "--zero", "0"])
    config = dataclasses.replace(config, dp=dp, vocab_size=test_moe.VOCAB)
    grid = dist.Grid(dp, 1, 1, cp_, ep=ep)
    model, engine, _ = compose.build(config, grid)
    if unreduced:  # the planted bug: each cp rank's balance loss sees only its own chunks
        for layer in moe.layers(model).values():
            layer.cp = None
    x, y = test_moe.batch()
    x, y = (cp.local(t, cp_, grid.cp.rank) for t in (x, y))
    mine = slice(grid.dp_rank * GLOBAL // dp, (grid.dp_rank + 1) * GLOBAL // dp)
    batches = [(x[mine][i : i + b], y[mine][i : i + b]) for i in range(0, GLOBAL // dp, b)]
    out = dict(losses=[], aux=[], loads=[], rank=grid.rank)
    for step in range(STEPS):
        engine.set_lr(config.lr)
        before = grid.log.counts.copy()
        loss = train.forward_backward(model, engine, grid, batches, config)
        loss = torch.as_tensor(loss, dtype=torch.float64).reshape(1)
        out["losses"].append(grid.dp_cp.all_reduce(loss).item() / grid.dp_cp.size)
        norm = engine.reduce().sqrt().item()  # the means over dp_cp / edp, the experts' / ep
        if step == 0:
            # lists: tensors do not survive the spawned ranks' exit
            out["grads"] = {n: p.grad.tolist() for n, p in model.named_parameters()}
            out["cp_bytes"] = {
                k: v[1] - before.get(k, (0, 0))[1]
                for k, v in grid.log.counts.items()
                if k[1] == "cp" and k[0] == "all_reduce"
            }
        engine.step(norm=norm)
        stats = moe.step_stats(model, grid)
        out["aux"].append(stats["aux"])
        out["loads"].append(stats["load"].tolist())
    out["weights"] = {n: p.detach().tolist() for n, p in model.named_parameters()}
    return out


def two_ranks():
    """cp 2 alone, and the planted run (the same layout, the counts not summed over cp)."""
    return {"cp2": run(*LAYOUTS[0][1:]), "planted": run(*LAYOUTS[0][1:], unreduced=True)}


def four_ranks():
    return {"dp2-cp2-ep2": run(*LAYOUTS[1][1:])}


@pytest.fixture(scope="module")
def runs():
    ref = worlds.launch(run, 1, 1, 1, 1, GLOBAL, 1)[0]
    return ref, worlds.launch(two_ranks, 2) + worlds.launch(four_ranks, 4)


def compare(res, ref):
    """The largest relative difference of losses, aux, step 1's gradients and the last weights."""
    worst = dict(loss=0.0, aux=0.0, grad=0.0, weight=0.0)
    for got, want in zip(res["losses"], ref["losses"]):
        worst["loss"] = max(worst["loss"], abs(got - want) / abs(want))
    for got, want in zip(res["aux"], ref["aux"]):
        worst["aux"] = max(worst["aux"], abs(got - want) / abs(want))
    for key, name in (("grads", "grad"), ("weights", "weight")):
        for n, t in res[key].items():  # this rank's tensors (ep: its experts), by the dense name
            if err(t, ref[key][n]) > worst[name]:
                worst[name], worst[name + "_at"] = err(t, ref[key][n]), n
    return worst


def test_layouts_equal_one_process(runs):
    ref, results = runs
    assert all(a > 0.5 for a in ref["aux"]), ref["aux"]  # E sum f P >= 1 - rounding: it is there
    for name, *_ in LAYOUTS:
        ranks = [res for res in results if name in res]
        assert len(ranks) == (2 if name == "cp2" else 4)
        for res in ranks:
            assert res[name]["loads"] == ref["loads"], f"{name}: routing differs"
            worst = compare(res[name], ref)
            assert max(v for v in worst.values() if isinstance(v, float)) < RTOL, (
                name,
                res[name]["rank"],
                worst,
                RTOL,
            )


def test_a_missing_cp_reduction_fails(runs):
    ref, results = runs
    worst = compare(results[0]["planted"], ref)
    assert worst["aux"] > 10 * RTOL, worst  # the planted bug is caught by the aux comparison


def test_cp_bytes_equal_the_formula(runs):
    _, results = runs
    cfg = flags.model_config(flags.parse(ARGV))
    for name, _dp, cp_, _ep, b, accum in LAYOUTS:
        got = next(r for r in results if name in r)[name]["cp_bytes"].get(
            ("all_reduce", "cp", "float32"), 0
        )
        want = formulas.moe_cp_balance_bytes(b, cfg.n_experts, cfg.n_layer, accum, cp_)
        assert got == want, (name, got, want)
