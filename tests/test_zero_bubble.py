"""Zero-bubble pipelines: the backward split into B and W (wgrad.py), ZB-H1 as data checked by the
simulator against its bubble and memory formulas (pure), then ZB-H1 run against the dense model at
pp 4 and dp 2 x pp 2, and train.py's ZB-H1 against its 1F1B in the compositions (tp2 + SP, ZeRO-1
over dp, recompute, experts over ep2): bitwise."""

import contextlib
import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanomega import checkpoint, dist, formulas, pp, reshard, schedules, train, wgrad, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.schedules import Op, Trace, bubble_fraction, ops_in_order, peak_inflight, simulate
from test_layouts import COMMON, flags


# ---------------------------------------------------------------- the split backward, one process
def _gpt(arch):
    kw = dict(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
    return GPT(GPTConfig(**kw, **(dict(arch="llama", n_kv_head=1) if arch == "llama" else {})))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_split_linear_is_f_linear_bitwise_and_defers_to_w(arch):
    """The split entry computes F.linear's gradients bitwise (same GEMMs); deferred, no weight
    gradient exists after B, and after W every gradient is the same (the tied embedding, here on
    one stage, sums its two halves in another order: within one rounding of its largest sum)."""
    torch.manual_seed(0)
    dense = _gpt(arch)
    now, later = (wgrad.split_backward(copy.deepcopy(dense)) for _ in range(2))
    hooked = []  # (name, whether a gradient had arrived) per post-accumulate-grad hook
    for name, p in later.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: hooked.append((name, p.grad is not None))
        )
    x, y = torch.randint(0, 96, (2, 8)), torch.randint(0, 96, (2, 8))
    for step in range(2):  # the second backward accumulates into existing grads
        dense(x, y).backward()
        now(x, y).backward()
        with wgrad.deferring() as stash:
            later(x, y).backward()
        weights = {n for n, p in later.named_parameters() if any(p is w for w, _ in stash)}
        # after B: no deferred weight has a new gradient (its hook fired with none: ddp skips it)
        matrices = {n for n, p in later.named_parameters() if p.dim() == 2 and ".wpe." not in n}
        assert weights == matrices, weights  # every linear's weight, the tied LM head's included
        # (the tied embedding's lookup half arrives in B; a second backward finds last step's grad)
        untouched = weights - {"embed.wte.weight"}
        assert all(not arrived or step for name, arrived in hooked if name in untouched), hooked
        hooked.clear()
        wgrad.flush(stash)
        assert {name for name, arrived in hooked if arrived} == weights  # the hooks fire at W
        hooked.clear()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(dense.parameters(), now.parameters()))
    for (name, a), b in zip(dense.named_parameters(), later.parameters()):
        if name == "embed.wte.weight":
            assert (a.grad - b.grad).abs().max() <= 4 * torch.finfo(
                a.dtype
            ).eps * a.grad.abs().max()
        else:
            assert torch.equal(a.grad, b.grad), name
    assert "wgrad.linear" in later.ops_table()


def test_split_linear_shapes_and_bias():
    """2-D and 3-D inputs, with and without bias, a non-contiguous input: F.linear's gradients."""
    g = torch.Generator().manual_seed(1)
    for shape, bias, transpose in [((5, 7), True, False), ((2, 3, 7), False, False),
                                   ((2, 3, 7), True, True)]:  # fmt: skip
        x0 = torch.randn(shape, generator=g)
        x0 = x0.transpose(0, 1).contiguous().transpose(0, 1) if transpose else x0
        w0, b0 = torch.randn(4, 7, generator=g), torch.randn(4, generator=g) if bias else None
        grads = []
        for fn in (F.linear, wgrad.linear):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            b = b0.clone().requires_grad_() if bias else None
            fn(x, w, b).square().sum().backward()
            grads.append([t.grad for t in (x, w, b) if t is not None])
        assert all(torch.equal(a, b) for a, b in zip(*grads)), (shape, bias, transpose)


# ---------------------------------------------------------------- ZB-H1 as data
def zb_h1_idle(p, m, t_f, t_b, t_w):
    """Idle time per rank: Qi et al. 2024, Table 1 (ZB-H1, m >= p): (p-1)(T_F + T_B - T_W); for
    m < p fewer W fill the cool-down, (p-1)(t_f + t_b) - (m-1) t_w (ours, from the schedule)."""
    return (p - 1) * (t_f + t_b) - (min(m, p) - 1) * t_w


@pytest.mark.parametrize("times", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (3, 2, 2)])
def test_zb_h1_bubble_and_memory_equal_the_formulas(times):
    """Every rank idles (p-1)(t_f + t_b - t_w), a third of 1F1B's (p-1)(t_f + t_b + t_w) at unit
    times, and holds min(m, p) micro-batches (1F1B's peak, on its first rank); under the simulator's
    NCCL-strict rendezvous (no deadlock, message order agreed). W no longer than F or B (the
    paper's T_W <= T_F, T_B)."""
    t_f, t_b, t_w = times
    for p in (2, 3, 4):
        for m in (1, 2, p, 2 * p, 3 * p):
            traces = simulate(p, m, "zb-h1", t_f=t_f, t_b=t_b, t_w=t_w)
            span = max(e.end for t in traces for e in t.events)
            idle = {span - sum(e.end - e.start for e in t.events) for t in traces}
            assert idle == {zb_h1_idle(p, m, t_f, t_b, t_w)}, (p, m, idle)
            assert [peak_inflight(t) for t in traces] == [min(m, p)] * p, (p, m)
            one_f_one_b = simulate(p, m, "1f1b", t_f=t_f, t_b=t_b + t_w)
            span_1f1b = max(e.end for t in one_f_one_b for e in t.events)
            assert span_1f1b - m * (t_f + t_b + t_w) == (p - 1) * (t_f + t_b + t_w)


def _moved(p, rank, m, v=1, move=None):
    """ZB-H1 with rank 1's op at position i moved to position j."""
    ops = ops_in_order(schedules.zb_h1(p, rank, m, v))
    if rank == 1:
        i, j = move
        ops.insert(j, ops.pop(i))
    return [[op] for op in ops]


@pytest.mark.parametrize(
    "move, error",
    [
        # rank 1 (F0 F1 F2 B0 F3 B1 W0 ...) waits for gradient 0 before sending forward 1, which
        # rank 2 needs before it computes that gradient
        ((3, 1), "deadlocks"),
        ((6, 3), "after"),  # W0 before its B0
        ((2, 1), "disagree on message order"),  # F2 before F1: sent in another order
    ],
)
def test_simulator_rejects_a_misordered_zb_h1(move, error):
    ops = ops_in_order(schedules.zb_h1(4, 1, 8))
    assert ops[:7] == [Op(k, mb) for k, mb in zip("FFFBFBW", (0, 1, 2, 0, 3, 1, 0))]
    simulate(4, 8, "zb-h1", t_b=1, t_w=1)  # the schedule itself passes
    with pytest.raises(RuntimeError, match=error):
        simulate(4, 8, lambda p, r, m, v: _moved(p, r, m, v, move), t_b=1, t_w=1)


def test_refusals():
    with pytest.raises(ValueError, match="--virtual-stages 2 needs --schedule interleaved"):
        pp.check_args(8, 4, 8, "zb-h1", 2)
    with pytest.raises(ValueError, match="drop --compile"):
        pp.check_args(8, 4, 8, "zb-h1", 1, compiled=True)
    pp.check_args(8, 4, 3, "zb-h1")  # any micro-batch count


# ---------------------------------------------------------------- against the dense model, on gloo
VOCAB, SEQ, MB, STEPS = 96, 8, 2, 3


def _case(grid, n_layer, m):
    """ZB-H1 on this stage and the dense model, 3 SGD steps: the largest differences, the op order
    the runtime ran, its peak in-flight micro-batches, how many ops ran under no_sync."""
    torch.manual_seed(0)
    dense = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=n_layer, n_head=2, n_embd=32))
    stage = wgrad.split_backward(pp.build_stage(copy.deepcopy(dense), grid))
    opts = [torch.optim.SGD(mod.parameters(), lr=0.5, momentum=0.9) for mod in (stage, dense)]
    diff, no_sync = {"loss": 0.0, "grad_step1": 0.0, "grad": 0.0, "weight": 0.0}, []
    dense_params = dict(dense.named_parameters())
    dense_name = {"head.lm_head.weight": "embed.wte.weight"}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + m)
        batches = [
            tuple(torch.randint(0, VOCAB, (MB, SEQ), generator=g) for _ in "xy") for _ in range(m)
        ]
        trace = Trace(grid.pp_rank)
        loss = pp.train_step(
            stage,
            grid,
            batches,
            "zb-h1",
            trace=trace,
            no_sync=lambda: no_sync.append(1) or contextlib.nullcontext(),
        )
        pp.sync_tied_grads(stage, grid)
        losses = [dense(x, y) for x, y in batches]
        for lo in losses:
            (lo / m * 1.0).backward()
        diff["loss"] = max(diff["loss"], abs(loss - torch.stack(losses).mean().item()))
        for name, p in stage.named_parameters():
            d = (p.grad - dense_params[dense_name.get(name, name)].grad).abs().max().item()
            key = "grad_step1" if step == 0 and pp.tied_embedding(stage, grid) is not p else "grad"
            diff[key] = max(diff[key], d)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for name, p in stage.named_parameters():
        d = (p - dense_params[dense_name.get(name, name)]).abs().max().item()
        diff["weight"] = max(diff["weight"], d)
    ran = [Op(e.op, e.mb, e.chunk) for e in trace.events]
    return dict(diff=diff, ran=ran, inflight=trace.peak_inflight, no_sync=len(no_sync))


def _world(layouts):
    return [
        (dist.Grid(dp, p, 1).pp_rank, [_case(dist.Grid(dp, p, 1), n, m) for n, m in cases])
        for dp, p, cases in layouts
    ]


LAYOUTS = [(1, 4, [(6, m) for m in (1, 4, 6)]), (2, 2, [(5, m) for m in (2, 3)])]


def test_zb_h1_equals_dense():
    """As tests/test_pp.py's 1F1B: the first step's gradients bitwise (every op the dense model's,
    in its order), losses and weights within 1e-6 (the tied embedding's two halves are summed in
    another order, which reaches every weight from step 2). The runtime ran the schedule's op list;
    it held min(m, p) micro-batches (the formula above); every B and all W but the last ran under
    no_sync (the buckets reduce at the last W)."""
    results = worlds.launch(_world, 4, LAYOUTS, timeout=300)
    for rank_results in results:
        for (dp, p, cases), (rank, case_results) in zip(LAYOUTS, rank_results):
            for (_, m), r in zip(cases, case_results):
                where, d = f"dp={dp} p={p} m={m} pp_rank={rank}", r["diff"]
                assert d["grad_step1"] == 0.0 and d["loss"] <= 1e-6, (where, d)
                assert d["grad"] <= 1e-6 and d["weight"] <= 1e-6, (where, d)
                assert r["ran"] == ops_in_order(schedules.zb_h1(p, rank, m)), where
                assert r["inflight"] == min(m, p), where
                assert r["no_sync"] == STEPS * (2 * m - 1), where


# ---------------------------------------------------------------- train.py: ZB-H1 == its 1F1B
LLAMA_MOE = ["--arch", "llama", "--n-kv-head", "2", "--n-experts", "4", "--top-k", "2"]
COMPOSED = [
    ("pp4", ["--pp", "4", "--batch-size", "1", "--grad-accum", "8"]),
    ("tp2-sp-pp2-selective", ["--tp", "2", "--sequence-parallel", "--pp", "2", "--recompute",
                              "selective", "--batch-size", "2", "--grad-accum", "4"]),
    ("dp2-pp2-zero1-full", ["--pp", "2", "--zero", "1", "--recompute", "full", "--batch-size", "1",
                            "--grad-accum", "4"]),
    ("moe-ep2-pp2-zero1", [*LLAMA_MOE, "--ep", "2", "--pp", "2", "--zero", "1", "--batch-size",
                           "1", "--grad-accum", "4"]),
]  # fmt: skip


def _train_both(corpus, root):
    for name, extra in COMPOSED:
        for schedule in ("1f1b", "zb-h1"):
            train.main(flags(corpus, Path(root) / f"{name}-{schedule}", [*extra, "--schedule",
                                                                          schedule]))  # fmt: skip
    return True


def test_train_zb_h1_equals_1f1b_bitwise(corpus, tmp_path):
    """The same layout under --schedule zb-h1 and 1f1b (tp2 + SP with selective recompute, ZeRO-1
    over dp 2 with full recompute, experts over ep 2): every loss, the validation loss and the final
    weights bitwise
    (B and W are F.linear's GEMMs, every gradient accumulates in the same micro-batch order);
    1F1B itself equals the dense model (tests/test_layouts.py, test_pp.py)."""
    worlds.launch(_train_both, 4, corpus, tmp_path, timeout=600)
    for name, _ in COMPOSED:
        curves = []
        for schedule in ("1f1b", "zb-h1"):
            metrics = tmp_path / f"{name}-{schedule}" / "metrics.jsonl"
            recs = [json.loads(line) for line in open(metrics)]
            curves.append(([r["loss"] for r in recs if "loss" in r], recs[-1]["val_loss"]))
        steps = int(COMMON[COMMON.index("--max-steps") + 1])
        assert curves[0] == curves[1] and len(curves[0][0]) == steps, (name, curves)
        # and the final weights, from the checkpoints (every parameter, by its dense name)
        a, b = (
            reshard.full_weights(checkpoint.latest(tmp_path / f"{name}-{s}"))
            for s in ("1f1b", "zb-h1")
        )
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_planner_prices_zb_h1_with_the_simulated_bubble():
    """The planner's ZB-H1 bubble (formulas.pipeline_bubble at ZB_H1_SLOTS, T_F = T_B = T_W) is the
    simulator's idle share; its memory per stage is 1F1B's (p micro-batches at most)."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            traces = simulate(p, m, "zb-h1", t_f=1, t_b=1, t_w=1)
            bubble = formulas.pipeline_bubble(p, m, formulas.ZB_H1_SLOTS)
            assert abs(bubble_fraction(traces) - bubble) <= 1e-12, (p, m)
            assert formulas.inflight_microbatches(p, m, "zb-h1") == max(map(peak_inflight, traces))
