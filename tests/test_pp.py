"""Pipeline parallelism: schedule op orders and bubbles (pure, no processes), then one 4-rank gloo
world that trains every schedule for several m at pp 4 and at dp 2 x pp 2 against the dense model,
and checks the activation memory each schedule held."""

import contextlib
import copy

import pytest
import torch

from nanomega import dist, pp, recompute, schedules, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.schedules import Op, Trace, bubble_fraction, ops_in_order, simulate
from nanomega.timeline import draw_timeline
from tolerance import layout_rtol


# ---------------------------------------------------------------- op orders, checked without
# communication
def expected_1f1b(p, rank, m):
    """1F1B as a rule: run the next forward while fewer than p - rank micro-batches are in
    flight."""
    ops, f, b = [], 0, 0
    while b < m:
        if f < m and f - b < p - rank:
            ops.append(Op("F", f))
            f += 1
        else:
            ops.append(Op("B", b))
            b += 1
    return ops


def expected_interleaved(p, rank, m, v):
    """Megatron's index arithmetic: the k-th forward is micro-batch (k // pv) p + k % p of chunk (k
    // p) % v."""
    fwd = [Op("F", k // (p * v) * p + k % p, k // p % v) for k in range(m * v)]
    bwd = [Op("B", k // (p * v) * p + k % p, v - 1 - k // p % v) for k in range(m * v)]
    warmup = min(2 * (p - rank - 1) + (v - 1) * p, m * v)
    ops = fwd[:warmup]
    for k in range(m * v - warmup):
        ops += [fwd[warmup + k], bwd[k]]
    return ops + bwd[m * v - warmup :]


def order(ops):
    """A rank's ops as one short string, "F0F1B0...": what a failing case prints."""
    return "".join(f"{o.kind}{o.mb}" for o in ops)


def test_op_orders_literal():
    # p = 4, m = 6: Narayanan et al. 2021 fig. 4 (top), the stage that waits longest for its first
    # backward, and the last stage; p = 4, m = 2: fewer micro-batches than stages, so the warm-up
    # stops at m (the case a warm-up of p - rank - 1 forwards gets wrong)
    for p, rank, m, want in [
        (4, 0, 6, "F0F1F2F3B0F4B1F5B2B3B4B5"),
        (4, 3, 6, "F0B0F1B1F2B2F3B3F4B4F5B5"),
        (4, 0, 2, "F0F1B0B1"),
        (3, 0, 1, "F0B0"),
    ]:
        got = order(ops_in_order(schedules.one_f_one_b(p, rank, m)))
        assert got == want, f"1f1b p={p} rank={rank} m={m}: got {got}, want {want}"
    assert (
        "".join(f"{o.kind}{o.mb}" for o in ops_in_order(schedules.gpipe(4, 2, 3))) == "F0F1F2B0B1B2"
    )
    assert (
        "".join(
            f"{o.kind}{o.mb}{'ab'[o.chunk]}"
            for o in ops_in_order(schedules.interleaved_1f1b(2, 1, 4, 2))
        )
        == "F0aF1aF0bB0bF1bB1bF2aB0aF3aB1aF2bB2bF3bB3bB2aB3a"
    )


@pytest.mark.parametrize("p", range(1, 9))
def test_op_orders_many(p):
    for m in range(1, 3 * p + 2):
        for rank in range(p):
            gpipe = [Op("F", i) for i in range(m)] + [Op("B", i) for i in range(m)]
            assert ops_in_order(schedules.gpipe(p, rank, m)) == gpipe
            got = order(ops_in_order(schedules.one_f_one_b(p, rank, m)))
            want = order(expected_1f1b(p, rank, m))
            assert got == want, f"1f1b p={p} rank={rank} m={m}: got {got}, want {want}"
            for v in (2, 3):
                if p > 1 and m % p == 0:
                    ops = ops_in_order(schedules.interleaved_1f1b(p, rank, m, v))
                    assert ops == expected_interleaved(p, rank, m, v)


@pytest.mark.parametrize("schedule,vs", [("gpipe", [1]), ("1f1b", [1]), ("interleaved", [2, 3, 4])])
def test_unit_clock_bubble_equals_formula(schedule, vs):
    """F = 1 unit, B = 2 units, free messages, every batched p2p a rendezvous: no deadlock, peers
    agree on the message order, and the idle share equals (p - 1) / (v m + p - 1) exactly (balanced
    stages)."""
    for v in vs:
        for p in range(2 if v > 1 else 1, 9):
            for m in range(p if v > 1 else 1, 4 * p + 2, p if v > 1 else 1):
                traces = simulate(p, m, schedule, v)
                assert bubble_fraction(traces) == pytest.approx(
                    (p - 1) / (v * m + p - 1), abs=1e-12
                ), (p, m, v)


def test_forward_only_plans_never_deadlock():
    for v in (1, 2, 3):
        for p in range(2, 9):
            for m in range(1, 3 * p + 2):  # any m, also m < p and m % p != 0
                traces = simulate(p, m, schedules.forward_only, v)
                assert sum(len(t.events) for t in traces) == p * v * m


def test_simulator_catches_deadlock():
    # interleaved 1F1B with p2p after every op instead of after each forward+backward pair: the
    # chunk ring (last rank -> first rank) deadlocks; this is why interleaved_1f1b pairs its
    # steady-state ops
    def unpaired(p, rank, m, v):
        return [[op] for op in ops_in_order(schedules.interleaved_1f1b(p, rank, m, v))]

    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(4, 8, unpaired, 2)


def test_timeline_drawing(tmp_path):
    text = draw_timeline(simulate(4, 6, "1f1b"), path=tmp_path / "timeline.png")
    rows = text.splitlines()
    assert rows[0].startswith("rank 0 |F0 F1 F2 F3 ....") and rows[3].startswith(
        "rank 3 |.........F0 B0    F1"
    )
    assert len(rows) == 5 and ("PNG written" in rows[4] or "matplotlib is not installed" in rows[4])


@pytest.mark.parametrize(
    "args,flag",
    [
        ((4, 5, 4, "1f1b"), "--pp 5 is larger than --n-layer 4"),
        ((4, 2, 0, "gpipe"), "--microbatches must be >= 1"),
        (
            (6, 2, 4, "interleaved", 2),
            "--n-layer 6 is not divisible by --pp 2 x --virtual-stages 2",
        ),
        ((8, 2, 5, "interleaved", 2), "--microbatches 5 is not a multiple of --pp 2"),
        ((8, 2, 4, "interleaved", 1), "needs --pp >= 2 and --virtual-stages >= 2"),
        ((8, 2, 4, "1f1b", 2), "--virtual-stages 2 needs --schedule interleaved"),
        ((8, 2, 4, "pipedream"), "--schedule 'pipedream' is unknown"),
    ],
)
def test_bad_input(args, flag):
    with pytest.raises(ValueError, match=flag.replace("(", r"\(")) as err:
        pp.check_args(*args)
    assert "\n" not in str(err.value)


def test_stage_layers_balanced():
    assert [list(pp.stage_layers(6, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4], [5]]
    assert [len(pp.stage_layers(10, 3, r)) for r in range(3)] == [4, 3, 3]
    for n_layer in range(1, 20):
        for p in range(1, n_layer + 1):
            assert [i for r in range(p) for i in pp.stage_layers(n_layer, p, r)] == list(
                range(n_layer)
            )


# ---------------------------------------------------------------- against the dense model, on gloo
VOCAB, SEQ, MB, STEPS = 96, 8, 2, 3
# one batch of every sequence against micro-batches: other sum orders in the blocks (width 4h = 128,
# at most 8 layers x 4 reductions + head) and in the loss's mean: a layout's bound at step 1
# (tests/tolerance.py)
EVAL_RTOL = layout_rtol(1, vocab=VOCAB, width=128, depth=33)


def _batches(m, step):
    g = torch.Generator().manual_seed(100 * step + m)
    return [
        (
            torch.randint(0, VOCAB, (MB, SEQ), generator=g),
            torch.randint(0, VOCAB, (MB, SEQ), generator=g),
        )
        for _ in range(m)
    ]


def _dense_name(name):
    return "embed.wte.weight" if name == "head.lm_head.weight" else name


def _case(grid, schedule, v, n_layer, m):
    """3 SGD steps of the pipeline stage and of the dense model; max |difference| of losses, grads,
    weights."""
    torch.manual_seed(0)
    dense = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=n_layer, n_head=2, n_embd=32))
    stage = pp.build_stage(copy.deepcopy(dense), grid, v)
    opts = [torch.optim.SGD(mod.parameters(), lr=0.5, momentum=0.9) for mod in (stage, dense)]
    no_sync_entries, diff = (
        [],
        {"loss": 0.0, "grad_step1": 0.0, "grad": 0.0, "tied_grad": 0.0, "weight": 0.0},
    )
    dense_params = dict(dense.named_parameters())
    for step in range(STEPS):
        batches = _batches(m, step)
        trace = Trace(grid.pp_rank)
        loss = pp.train_step(
            stage,
            grid,
            batches,
            schedule,
            virtual=v,
            trace=trace,
            no_sync=lambda: no_sync_entries.append(1) or contextlib.nullcontext(),
        )
        pp.sync_tied_grads(stage, grid)
        losses = []
        for x, y in batches:  # the dense reference: same micro-batches, same loss / m accumulation
            losses.append(dense(x, y))
            (losses[-1] / m * 1.0).backward()
        diff["loss"] = max(diff["loss"], abs(loss - torch.stack(losses).mean().item()))
        for name, p in stage.named_parameters():
            d = (p.grad - dense_params[_dense_name(name)].grad).abs().max().item()
            key = (
                "tied_grad"
                if pp.tied_embedding(stage, grid) is p
                else "grad_step1"
                if step == 0
                else "grad"
            )
            diff[key] = max(diff[key], d)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for name, p in stage.named_parameters():
        diff["weight"] = max(
            diff["weight"], (p - dense_params[_dense_name(name)]).abs().max().item()
        )
    rounds = schedules.SCHEDULES[schedule](grid.pp.size, grid.pp_rank, m, v)
    backwards = sum(op.kind == "B" for op in ops_in_order(rounds))
    return dict(
        diff=diff,
        inflight=trace.peak_inflight,
        held=trace.peak_output_bytes,
        no_sync=len(no_sync_entries),
        expected_no_sync=STEPS * (backwards - 1),  # all but the rank's last
    )


def _memory(grid, n_layer, m):
    """Peak saved activations (ActivationMeter) for GPipe and 1F1B, and outputs held without
    deallocation."""
    torch.manual_seed(0)
    stage = pp.build_stage(
        GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=n_layer, n_head=2, n_embd=32)), grid
    )
    peaks = {}
    for schedule, mm in (("gpipe", 1), ("gpipe", m), ("1f1b", m)):
        with recompute.ActivationMeter(stage) as meter:
            pp.train_step(stage, grid, _batches(mm, 0), schedule)
        peaks[(schedule, mm)] = meter.peak
    trace = Trace(grid.pp_rank)
    pp.train_step(stage, grid, _batches(m, 0), "1f1b", trace=trace, deallocate=False)
    return dict(peaks=peaks, held_no_dealloc=trace.peak_output_bytes)


def _evaluation(grid, v, n_layer):
    """pp.forward_only against the dense model's mean loss per sequence, for m below, at and not a
    multiple of p, and with a ragged last micro-batch (an evaluation whose validation windows ran
    out: its activations are smaller, and it weighs 1 sequence, not MB). Returns (largest difference
    to the dense micro-batches' losses combined by pp.sequence_mean: bitwise expected; largest
    relative difference to the dense loss of all the sequences in one batch: the same mean, summed
    in another order)."""
    torch.manual_seed(0)
    dense = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=n_layer, n_head=2, n_embd=32))
    stage = pp.build_stage(copy.deepcopy(dense), grid, v)
    diffs, rel = [], []
    for m, ragged in ((1, False), (grid.pp.size + 1, False), (grid.pp.size + 1, True)):
        batches = _batches(m, 7)
        if ragged:
            batches[-1] = tuple(t[:1] for t in batches[-1])
        with torch.no_grad():
            losses = torch.stack([dense(x, y) for x, y in batches])
            # one mean over every sequence
            whole = dense(*(torch.cat(t) for t in zip(*batches))).item()
        got = pp.forward_only(stage, grid, batches, virtual=v)
        diffs.append(abs(got - pp.sequence_mean(losses, [len(x) for x, _ in batches])))
        rel.append(abs(got - whole) / whole)
    return max(diffs), max(rel)


def _world(layouts):
    """One 4-rank world for every layout: (1 x pp 4), then (dp 2 x pp 2), whose pp groups are not
    the world."""
    out = []
    for dp, p, cases, mem_layers in layouts:
        grid = dist.Grid(dp, p, 1)
        out.append(
            (
                grid.pp_rank,
                [_case(grid, *c) for c in cases],
                _memory(grid, mem_layers, 2 * p + 1),
                [_evaluation(grid, v, 2 * p) for v in (1, 2)],
            )
        )
    return out


LAYOUTS = [
    (
        1,
        4,
        [(s, 1, 6, m) for s in ("gpipe", "1f1b") for m in (1, 4, 9)]  # 6 layers: 2 + 2 + 1 + 1
        + [("interleaved", 2, 8, m) for m in (4, 8)],
        6,
    ),
    # 5 layers: uneven stages 3 + 2
    (
        2,
        2,
        [(s, 1, 5, m) for s in ("gpipe", "1f1b") for m in (1, 2, 5)]
        + [("interleaved", 2, 4, m) for m in (2, 4)],
        5,
    ),
]


def test_pipeline_equals_dense():
    act_bytes = MB * SEQ * 32 * 4
    for rank_results in worlds.launch(_world, 4, LAYOUTS, timeout=300):
        for (dp, p, cases, _), (rank, case_results, mem, evals) in zip(LAYOUTS, rank_results):
            # forward_only: the dense ops, in the same order; and the mean per sequence, a ragged
            # last micro-batch weighted by its rows (the plain mean over micro-batches was 1.3e-4
            # off at pp 4 and 6.3e-5 at dp 2 x pp 2, relative: EVAL_RTOL is 3.3e-5)
            assert max(d for d, _ in evals) == 0.0, (dp, p, evals)
            assert max(r for _, r in evals) <= EVAL_RTOL, (dp, p, evals)
            for (schedule, v, _, m), r in zip(cases, case_results):
                where = f"{schedule} dp={dp} p={p} m={m} pp_rank={rank}"
                d = r["diff"]
                # same ops in the same order as the dense model: bitwise, except the tied embedding,
                # whose two halves (embedding grad on the first stage, head grad on the last) are
                # summed in another order; that rounding difference reaches every weight in steps 2
                # and 3, hence 1e-6 there
                assert d["loss"] <= 1e-6 and d["grad_step1"] == 0.0, (where, d)
                assert d["tied_grad"] <= 1e-7 and d["grad"] <= 1e-6 and d["weight"] <= 1e-6, (
                    where,
                    d,
                )
                assert r["no_sync"] == r["expected_no_sync"], where
                assert r["held"] == 0, where  # sent outputs were freed (deallocate trick)
                if schedule == "gpipe":
                    assert r["inflight"] == m, where
                elif schedule == "1f1b":
                    assert r["inflight"] == min(m, p - rank), where
                else:
                    assert r["inflight"] == min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1), where
            m, peaks = 2 * p + 1, mem["peaks"]
            # GPipe: all m micro-batches' activations
            assert peaks[("gpipe", m)] == m * peaks[("gpipe", 1)] > 0
            # 1F1B: at most p - rank
            assert peaks[("1f1b", m)] == min(m, p - rank) * peaks[("gpipe", 1)]
            assert mem["held_no_dealloc"] == (0 if rank == p - 1 else (p - rank) * act_bytes)
