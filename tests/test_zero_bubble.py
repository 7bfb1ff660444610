"""Zero-bubble pipelines: the backward split into B and W (wgrad.py), ZB-H1 and ZB-H2 as data
checked by the simulator against their bubble and memory formulas (pure), then both run against the
dense model at pp 4 and dp 2 x pp 2, and train.py's ZB-H1 and ZB-H2 against its 1F1B in the
compositions (tp2 + SP, ZeRO-1 over dp, recompute, experts over ep2): bitwise."""

import copy

import pytest
import torch
import torch.nn.functional as F

import zb_dense
from nanomega import formulas, pp, recompute, schedules, wgrad, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.schedules import Op, bubble_fraction, ops_in_order, peak_inflight, simulate

SPLIT_LOOP = ["1f1b", "zb-h1", "zb-h2"]  # train.py's runs: 1F1B and the split schedules on the loop


# ---------------------------------------------------------------- the split backward, one process
def _gpt(arch):
    kw = dict(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32)
    return GPT(GPTConfig(**kw, **(dict(arch="llama", n_kv_head=1) if arch == "llama" else {})))


@pytest.mark.parametrize("arch, mode", [("gpt", "none"), ("llama", "none"), ("llama", "full")])
def test_split_linear_is_f_linear_bitwise_and_defers_to_w(arch, mode):
    """The split entry computes F.linear's gradients bitwise (same GEMMs); deferred, no weight
    gradient exists after B, and after W every gradient is the same (the tied embedding, here on
    one stage, sums its two halves in another order: within one rounding of its largest sum).
    Under full recompute too: W hands its gradient to the parameter itself, not to the rerun's
    copy of it that backward unpacks (that gradient was lost once B had freed the graph)."""
    torch.manual_seed(0)
    dense = _gpt(arch)
    now, later = (wgrad.split_backward(copy.deepcopy(dense)) for _ in range(2))
    recompute.apply_recompute(later, mode)
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
        simulate(4, 8, zb_dense.moved(schedules.zb_h1, 1, move), t_b=1, t_w=1)


def test_refusals():
    with pytest.raises(ValueError, match="--virtual-stages 2 needs --schedule interleaved"):
        pp.check_args(8, 4, 8, "zb-h1", 2)
    with pytest.raises(ValueError, match="drop --compile"):
        pp.check_args(8, 4, 8, "zb-h1", 1, compiled=True)
    pp.check_args(8, 4, 3, "zb-h1")  # any micro-batch count
    with pytest.raises(ValueError, match="--virtual-stages 2 needs --schedule interleaved"):
        pp.check_args(8, 4, 8, "zb-h2", 2)
    with pytest.raises(ValueError, match="drop --compile"):
        pp.check_args(8, 4, 8, "zb-h2", 1, compiled=True)
    for m in (1, 3, 7, 9):
        pp.check_args(8, 4, m, "zb-h2")  # any micro-batch count (the simulator, above)


# ---------------------------------------------------------------- ZB-H2 as data
def own_span_idle(trace):
    """A rank's idle from its own first op to its own last: the bubble of a step whose optimizer
    synchronization is bypassed (the next step's first forward follows the rank's last W)."""
    start, end = min(e.start for e in trace.events), max(e.end for e in trace.events)
    return end - start - sum(e.end - e.start for e in trace.events)


@pytest.mark.parametrize("times", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (3, 2, 2), (2, 3, 1)])
def test_zb_h2_bubble_and_memory_equal_the_formulas(times):
    """Qi et al. 2024, Table 1, ZB-H2: the most any rank idles between its first and its last op is
    (p-1)(T_F + T_B - 2 T_W) for m >= 2p - 1 (zero at equal times: the parallelogram), and every
    rank holds min(m, 2p - 1) micro-batches (the paper's (2p - 1) M_B). The ranks start t_f apart,
    so a step that waits for every rank (nanomega's) adds (p - 1) t_f to each rank's idle (at equal
    times, checked here). Fewer micro-batches at equal times idle (2p - 1 - m) t (ours)."""
    t_f, t_b, t_w = times
    for p in (2, 3, 4, 8):
        for m in sorted({1, p, 2 * p - 2, 2 * p - 1, 2 * p, 3 * p}):
            traces = simulate(p, m, "zb-h2", t_f=t_f, t_b=t_b, t_w=t_w)
            idle = max(map(own_span_idle, traces))
            if m >= 2 * p - 1:
                assert idle == (p - 1) * (t_f + t_b - 2 * t_w), (p, m, idle)
            elif times == (1, 1, 1):
                assert idle == 2 * p - 1 - m, (p, m, idle)
            assert [peak_inflight(t) for t in traces] == [min(m, 2 * p - 1)] * p, (p, m)
            if times == (1, 1, 1) and m >= 2 * p - 1:
                span = max(e.end for t in traces for e in t.events)
                assert {span - 3 * m} == {p - 1}, (p, m, span)  # the synchronized step


@pytest.mark.parametrize(
    "rank, move, error",
    [
        # rank 1 (F0..F4 B0 F5 ...): B0 moved before F2, which rank 2 needs before gradient 0
        (1, (5, 2), "deadlocks"),
        (0, (8, 7), "after"),  # W0 before its B0
        (3, (1, 0), "after"),  # the last rank's B0 before its F0
    ],
)
def test_simulator_rejects_a_misordered_zb_h2(rank, move, error):
    ops = ops_in_order(schedules.zb_h2(4, 0, 8))
    assert ops[:10] == [Op("F", i) for i in range(7)] + [Op("B", 0), Op("W", 0), Op("F", 7)]
    simulate(4, 8, "zb-h2", t_b=1, t_w=1)  # the schedule itself passes
    with pytest.raises(RuntimeError, match=error):
        simulate(4, 8, zb_dense.moved(schedules.zb_h2, rank, move), t_b=1, t_w=1, timed=True)


# ---------------------------------------------------------------- against the dense model, on gloo
LAYOUTS = [
    (1, 4, "zb-h1", [(6, m) for m in (1, 4, 6)]),
    (2, 2, "zb-h1", [(5, m) for m in (2, 3)]),
    (1, 4, "zb-h2", [(6, m) for m in (1, 4, 7, 9)]),
    (2, 2, "zb-h2", [(5, m) for m in (2, 3)]),
]


def test_zb_h1_and_zb_h2_equal_dense():
    """As tests/test_pp.py's 1F1B: the first step's gradients bitwise (every op the dense model's,
    in its order), losses and weights within 1e-6 (the tied embedding's two halves are summed in
    another order, which reaches every weight from step 2). The runtime ran the schedule's op list
    (ZB-H2's p2p by timed_plan); it held min(m, p) (ZB-H1) and min(m, 2p - 1) (ZB-H2) micro-batches
    (the formulas above); every B and all W but the last ran under no_sync (the buckets reduce at
    the last W)."""
    results = worlds.launch(zb_dense.dense_world, 4, LAYOUTS, timeout=300)
    peaks = {"zb-h1": lambda p, m, r: min(m, p), "zb-h2": lambda p, m, r: min(m, 2 * p - 1)}
    zb_dense.check_dense(results, LAYOUTS, peaks, lambda m: 2 * m - 1)


# ---------------------------------------------------------------- train.py: ZB-H1, ZB-H2 == 1F1B
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
RUNS = [(f"{name}-{s}", [*extra, "--schedule", s]) for name, extra in COMPOSED for s in SPLIT_LOOP]


def test_train_zb_h1_zb_h2_equal_1f1b_bitwise(corpus, tmp_path):
    """The same layout under --schedule zb-h1, zb-h2 and 1f1b (pp 4; tp2 + SP with selective
    recompute; ZeRO-1 over dp 2 with full recompute; experts over ep 2 with ZeRO-1): every loss,
    the validation loss and the final weights bitwise (B and W are F.linear's GEMMs, every gradient
    accumulates in the same micro-batch order); 1F1B itself equals the dense model
    (tests/test_layouts.py, test_pp.py). ZeRO-2 beside pp is refused for every schedule
    (zero_rules.pipeline_error, tests/test_args.py)."""
    worlds.launch(zb_dense.train_runs, 4, corpus, tmp_path, RUNS, timeout=600)
    for name, _ in COMPOSED:
        for schedule in SPLIT_LOOP[1:]:
            zb_dense.bitwise_equal(tmp_path, f"{name}-1f1b", f"{name}-{schedule}")


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-h2", "zb-v", "dualpipev"])
def test_planner_prices_the_split_schedules_with_the_simulated_bubble(schedule):
    """The planner's bubble (formulas.pipeline_bubble at RAMP_SLOTS[schedule], T_F = T_B = T_W, the
    step synchronized) is the simulator's idle share; its activation memory per stage
    (inflight_microbatches, in stage micro-batches: ZB-V's chunks are half a stage) is the
    simulator's peak, and its per-stage rows (formulas.rank_inflight, what tools/cost_time.py and
    cp_cost.py hold per stage) each rank's peak: on the V every rank holds both ends. A wrong slot
    count (the paper's zero for ZB-H2, which needs the step post-validated: test_post_validate.py)
    fails here."""
    v = 2 if schedules.placement(schedule) == "v" else 1
    for p in (2, 4, 8):
        for m in (1, 2, p, 2 * p - 1, 2 * p, 4 * p):
            if schedule == "dualpipev" and m < 2 * p:
                continue  # DualPipeV takes m >= 2p (dualpipe.check)
            traces = simulate(p, m, schedule, v=v, t_f=1, t_b=1, t_w=1)
            bubble = formulas.pipeline_bubble(p, m, formulas.RAMP_SLOTS[schedule])
            if m >= 2 * p - 1:  # the formulas' range (fewer micro-batches: the ramp is longer)
                assert abs(bubble_fraction(traces) - bubble) <= 1e-12, (p, m)
            peak = max(map(peak_inflight, traces)) / v
            assert formulas.inflight_microbatches(p, m, schedule) == peak, (p, m)
            rows = [formulas.rank_inflight(p, r, m, schedule) for r in range(p)]
            assert rows == [peak_inflight(t) / v for t in traces], (p, m)
