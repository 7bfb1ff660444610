"""DualPipeV (nanomega/dualpipe.py): the V placement's schedule with overlapped forward-and-
backward pairs. As data, checked by the simulator against the DualPipe repository's bubble and
memory (pure); a misordered DualPipeV rejected; the refusals; then DualPipeV run against the dense
model at pp 2, pp 4 and dp 2 x pp 2, and train.py's dualpipev against its 1f1b."""

import json
from pathlib import Path

import pytest
import torch

from nanomega import checkpoint, dualpipe, moe_overlap, pp, reshard, schedules, train, worlds
from nanomega.schedules import Op, ops_in_order, peak_inflight, simulate
import zb_dense
from test_layouts import COMMON, RTOL, flags


# ---------------------------------------------------------------- DualPipeV as data
def dualpipe_bubble(p, t_f, t_b, t_w):
    """Idle per rank, the DualPipe repository's table (PP = 2p stages): (PP/2 - 1)(F&B + B - 3W),
    B a full backward (t_b + t_w), F&B an overlapped pair; on CPU nothing overlaps, so F&B is the
    pair's sum t_f + t_b + t_w."""
    fb, b = t_f + t_b + t_w, t_b + t_w
    return (p - 1) * (fb + b - 3 * t_w)


def test_dualpipev_bubble_and_memory_equal_the_formulas():
    """Every rank idles dualpipe_bubble and holds 2p + 1 chunk micro-batches from F to W (the
    table's PP + 1), under the simulator's NCCL-strict rendezvous (no deadlock, message order
    agreed), p 2, 3, 4, 8 with m from 2p to 3p. At T_F = T_B = T_W (the repository's figure: a
    full backward two cells) and at T_W = 0: the plan's calls are timed on that unit clock, as
    ZB-V's; other times idle more (p 4, (2, 1, 1): 12, the table says 9)."""
    for p in (2, 3, 4, 8):
        for m in sorted({2 * p, 2 * p + 1, 3 * p}):
            for times in ((1, 1, 1), (1, 1, 0)):
                traces = simulate(p, m, "dualpipev", v=2, t_f=times[0], t_b=times[1], t_w=times[2])
                span = max(e.end for t in traces for e in t.events)
                idle = {span - sum(e.end - e.start for e in t.events) for t in traces}
                assert idle == {dualpipe_bubble(p, *times)}, (p, m, times, idle)
                assert [peak_inflight(t) for t in traces] == [2 * p + 1] * p, (p, m)
                assert all(len(t.events) == 6 * m for t in traces), (p, m)


def test_dualpipev_pairs():
    """The steady state is overlapped pairs (a forward of one micro-batch, the full backward of
    another on the other chunk), m - 2p + r + 1 of each kind on rank r (the last rank's first one
    split in two, as in DeepSeek's code), and the ops run in rounds: a pair is never cut by a p2p
    call, all its receives posted before it."""
    p, m = 4, 10
    for rank in range(p):
        rounds = schedules.dualpipev(p, rank, m)
        pairs = dualpipe.pairs(rounds)
        steady = m - 2 * p + rank + 1
        assert len(pairs) == 2 * steady - (rank == p - 1) + (p - rank - 1), rank
        for f, b in pairs:
            assert f.kind == "F" and b.kind == "B" and f.chunk != b.chunk and f.mb != b.mb
        plan = schedules.rank_plan(schedules.dualpipev, p, rank, m, 2, "v")
        ops = [i for i, s in enumerate(plan) if isinstance(s, Op)]
        for f, b in pairs:
            i = plan.index(f)
            assert plan[i + 1 : i + 3] == [b, Op("W", b.mb, b.chunk)], (rank, f)
    assert ops_in_order(schedules.dualpipev(4, 0, 8))[:8] == [Op("F", i, 0) for i in range(6)] + [
        Op("F", 6, 0),
        Op("F", 0, 1),
    ]
    assert len(ops) == 6 * m


@pytest.mark.parametrize(
    "rank, move, error",
    [
        # rank 0's F0 5 moved after its F1 1, which needs rank 1's F1 1, which runs after rank 1's
        # F0 5, which needs rank 0's
        (0, (5, 10), "deadlock"),
        # rank 3, the V's turn: F1 0 before the F0 0 whose output it takes
        (3, (1, 0), "deadlock"),
        (0, (9, 8), "after"),  # W1 0 before its B1 0
    ],
)
def test_simulator_rejects_a_misordered_dualpipev(rank, move, error):
    ops = ops_in_order(schedules.dualpipev(4, 0, 8))
    assert ops[6:11] == [Op("F", 6, 0), Op("F", 0, 1), Op("B", 0, 1), Op("W", 0, 1), Op("F", 1, 1)]
    assert ops_in_order(schedules.dualpipev(4, 3, 8))[:2] == [Op("F", 0, 0), Op("F", 0, 1)]
    simulate(4, 8, "dualpipev", v=2, t_b=1, t_w=1)  # the schedule itself passes
    with pytest.raises(RuntimeError, match=error):
        simulate(
            4, 8, zb_dense.moved(schedules.dualpipev, rank, move), v=2, t_b=1, t_w=1, place="v"
        )


def test_refusals():
    for virtual in (1, 3):
        with pytest.raises(ValueError, match="needs --pp >= 2 and --virtual-stages 2"):
            pp.check_args(8, 4, 8, "dualpipev", virtual)
    with pytest.raises(ValueError, match="needs --pp >= 2 and --virtual-stages 2"):
        pp.check_args(8, 1, 8, "dualpipev", 2)
    for m in (1, 3, 7):
        with pytest.raises(ValueError, match="at least 2 x pp micro-batches.*--grad-accum >= 8"):
            pp.check_args(8, 4, m, "dualpipev", 2)
    with pytest.raises(ValueError, match="drop --compile"):
        pp.check_args(8, 4, 8, "dualpipev", 2, compiled=True)
    with pytest.raises(ValueError, match="larger than --n-layer"):
        pp.check_args(6, 4, 8, "dualpipev", 2)  # 2p chunks need 2p layers
    for m in (8, 9, 13):
        pp.check_args(8, 4, m, "dualpipev", 2)


# ---------------------------------------------------------------- against the dense model, on gloo
LAYOUTS = [
    (1, 4, "dualpipev", [(8, m) for m in (8, 11)]),
    (2, 2, "dualpipev", [(4, m) for m in (4, 5)]),
]


def test_dualpipev_equals_dense():
    """As ZB-V's test: the first step's gradients bitwise except the tied embedding's, losses
    and weights within 1e-6; the runtime ran the schedule's op list and held 2p + 1 chunk
    micro-batches; every B and W but the rank's last W ran under no_sync."""
    results = worlds.launch(zb_dense.dense_world, 4, LAYOUTS, timeout=300)
    for rank_results in results:
        for (dp, p, _, cases), (rank, case_results) in zip(LAYOUTS, rank_results):
            for (_, m), r in zip(cases, case_results):
                where, d = f"dp={dp} p={p} m={m} pp_rank={rank}", r["diff"]
                assert d["grad_step1"] == 0.0 and d["loss"] <= 1e-6, (where, d)
                assert d["grad"] <= 1e-6 and d["weight"] <= 1e-6, (where, d)
                assert r["ran"] == ops_in_order(schedules.dualpipev(p, rank, m)), where
                assert r["inflight"] == 2 * p + 1, where


# ---------------------------------------------------------------- train.py: dualpipev against 1f1b
TRAINED = [
    # untied (a Llama): every parameter's gradient is 1F1B's, bitwise
    ("llama-pp4-untied", ["--arch", "llama", "--n-kv-head", "2", "--untie-embeddings", "--pp", "4",
                          "--n-layer", "8", "--batch-size", "1", "--grad-accum", "8"], True),
    # tp 2 + SP with selective recompute
    ("llama-tp2-sp-pp2-untied", ["--arch", "llama", "--n-kv-head", "2", "--untie-embeddings", "--tp",
                                 "2", "--sequence-parallel", "--pp", "2", "--recompute", "selective",
                                 "--batch-size", "1", "--grad-accum", "4"], True),
    # experts over ep 2 (dp 2 = ep 2 here), their all-to-alls overlapped in the pairs: every
    # training loss bitwise, the validation loss after the last step within RTOL (6e-9 apart)
    ("moe-ep2-pp2", ["--arch", "llama", "--n-kv-head", "2", "--n-experts", "4", "--top-k", "2",
                     "--untie-embeddings", "--ep", "2", "--pp", "2", "--batch-size", "1",
                     "--grad-accum", "4"], "train"),
    # tied, ZeRO-1 over dp 2: the tied matrix's halves sum in another order (within RTOL)
    ("dp2-pp2-zero1", ["--pp", "2", "--zero", "1", "--batch-size", "1", "--grad-accum", "4"],
     False),
]  # fmt: skip


def _train_both(corpus, root):
    """Train every layout under both schedules; moe_overlap's LOG of the MoE run under dualpipev."""
    log = []
    for name, extra, _ in TRAINED:
        for schedule, virtual in (("1f1b", "1"), ("dualpipev", "2")):
            run = [*extra, "--schedule", schedule, "--virtual-stages", virtual]
            moe_overlap.RECORD[:] = [1] if name.startswith("moe") and schedule != "1f1b" else []
            moe_overlap.LOG[:] = []
            train.main(flags(corpus, Path(root) / f"{name}-{schedule}", run))
            log = list(moe_overlap.LOG) if moe_overlap.RECORD else log
            moe_overlap.RECORD[:] = []
    return log


def test_train_dualpipev_equals_1f1b(corpus, tmp_path):
    """train.py end to end under --schedule dualpipev, as ZB-V's: untied (pp 4; tp 2 + SP x pp 2
    with selective recompute), every loss, the validation loss and the final weights bitwise
    1F1B's; experts over ep 2, their pairs' all-to-alls overlapped (the order read from
    moe_overlap.LOG), every training loss bitwise, the validation loss within RTOL; tied with
    ZeRO-1 over dp 2, within the layouts' RTOL."""
    logs = worlds.launch(_train_both, 4, corpus, tmp_path, timeout=600)
    # the MoE overlap's order on every rank: each all-to-all of a pair waited for after the other
    # micro-batch computed (moe_overlap.ENABLED False: none is, total 0, the test fails)
    for rank, log in enumerate(logs):
        covered, total = overlapped(log)
        assert covered == total > 0, (rank, covered, total)
    steps = int(COMMON[COMMON.index("--max-steps") + 1])
    for name, _, bitwise in TRAINED:
        curves, weights = [], []
        for run in ("1f1b", "dualpipev"):
            recs = [json.loads(line) for line in open(tmp_path / f"{name}-{run}" / "metrics.jsonl")]
            curves.append([r["loss"] for r in recs if "loss" in r] + [recs[-1]["val_loss"]])
            weights.append(reshard.full_weights(checkpoint.latest(tmp_path / f"{name}-{run}")))
        assert len(curves[0]) == steps + 1 and weights[0].keys() == weights[1].keys(), name
        if bitwise == "train":  # the training losses; the last step's update and val within RTOL
            assert curves[0][:-1] == curves[1][:-1], (name, curves)
            assert curves[1][-1] == pytest.approx(curves[0][-1], rel=RTOL), (name, curves)
        elif bitwise:
            assert curves[0] == curves[1], (name, curves)
            assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), name
        else:
            assert curves[1] == pytest.approx(curves[0], rel=RTOL), (name, curves)


# ---------------------------------------------------------------- the MoE overlap's order
def overlapped(log):
    """(all-to-alls waited for with the other side's compute between their issue and their wait,
    all waited for) in a moe_overlap.LOG: the first must equal the second, except where the other
    side had already ended."""
    pending, ended, covered, total = {}, set(), 0, 0
    for event, side in log:
        other = "B" if side == "F" else "F"
        if event == "issue":
            pending[side] = other in ended
        elif event == "run":  # the other side's pending all-to-all now has compute under it
            pending = {s: c or s != side for s, c in pending.items()}
        elif event == "wait":
            covered, total = covered + pending.pop(side, False), total + 1
        elif event == "end":
            ended.add(side)
    return covered, total


def test_pair_hands_the_turn_at_each_all_to_all():
    """Two sides with two all-to-alls each (issue, hand-off, wait): every one is waited for after
    the other side computed; run one after the other (ENABLED False) none is."""
    done = []

    def side(name):
        def work():
            for i in range(2):
                done.append(f"{name} computes {i}")
                moe_overlap.handoff()  # just issued an all-to-all
                moe_overlap.waited()
            done.append(f"{name} computes the rest")
            return name

        return work

    moe_overlap.RECORD.append(1)
    try:
        for enabled in (True, False):
            moe_overlap.ENABLED, done[:], moe_overlap.LOG[:] = enabled, [], []
            assert moe_overlap.run_pair(side("F"), side("B")) == ("F", "B")
            covered, total = overlapped(moe_overlap.LOG)
            if enabled:
                assert done[:4] == ["F computes 0", "B computes 0", "F computes 1", "B computes 1"]
                assert (covered, total) == (4, 4), moe_overlap.LOG
            else:
                assert done[0:3] == ["F computes 0", "F computes 1", "F computes the rest"]
                assert total == 0  # outside a pair nothing hands off (nor logs)
    finally:
        moe_overlap.ENABLED, moe_overlap.RECORD[:] = True, []
