"""ZB-V: two model chunks per rank in a V (schedules.PLACEMENT), the first and the last stage both
on rank 0. The placement table (pure), the schedule as data checked by the simulator against its
bubble and memory (pure), a misordered ZB-V rejected, the refusals; then ZB-V run against the
dense model at pp 2, pp 4 and dp 2 x pp 2, and train.py's zb-v against its 1f1b."""

import pytest

import zb_dense
from nanomega import pp, schedules, worlds, zero_rules
from nanomega.schedules import Op, ops_in_order, peak_inflight, simulate
from test_layouts import RTOL

SCHEDS = ("1f1b", "zb-v")


# ---------------------------------------------------------------- the placement table
def test_placements():
    """The loop is Megatron's c p + r; the V holds r and 2p - 1 - r, so the first and the last
    virtual stage are on rank 0 and the turn p - 1 -> p stays on rank p - 1; each is the inverse
    of stage_rank."""
    assert schedules.placement("zb-v") == schedules.placement("dualpipev") == "v"
    others = set(schedules.SCHEDULES) - {"zb-v", "dualpipev"}
    assert {schedules.placement(s) for s in others} == {"loop"}
    for p in (2, 3, 4, 8):
        for place, v in (("loop", 1), ("loop", 3), ("v", 2)):
            held = {
                (r, c): schedules.virtual_stage(p, r, c, place) for r in range(p) for c in range(v)
            }
            assert sorted(held.values()) == list(range(p * v)), (p, place)
            assert all(schedules.stage_rank(vs, p, place) == r for (r, _), vs in held.items())
            if place == "loop":
                assert held == {(r, c): c * p + r for r in range(p) for c in range(v)}
        v_ranks = [schedules.stage_rank(vs, p, "v") for vs in range(2 * p)]
        assert v_ranks == [*range(p), *reversed(range(p))], v_ranks


# ---------------------------------------------------------------- ZB-V as data
def zb_v_idle(p, m):
    """Idle time per rank at t_f = t_b = t_w = 1 per chunk (ours, read off the schedule): (p - 1)
    for m >= 2p - 1, the V's ramp alone (rank p - 1 waits p - 1 chunk forwards for its first
    input; 1F1B idles (p - 1)(T_F + T_B + T_W) = 6(p - 1) in these units); fewer micro-batches
    leave 4(p - 1) - 2(m - 1)."""
    return max(p - 1, 4 * (p - 1) - 2 * (m - 1))


def zb_v_peak(p, m, rank):
    """Chunk micro-batches held from F to W on rank: 2p once m >= 2p - 1 on every rank, half-size
    chunks, so p stages' worth: Qi et al. 2024 sec. 6, ZB-V's p M_B (1F1B's peak); fewer
    micro-batches: min(2m, m + 1 + rank) (ours, from the schedule)."""
    return min(2 * p, 2 * m, m + 1 + rank)


def test_zb_v_bubble_and_memory_equal_the_formulas():
    """Every rank idles zb_v_idle and holds zb_v_peak, under the simulator's NCCL-strict
    rendezvous (no deadlock, message order agreed), p 2, 3, 4 with m from 1 to 3p, p 8 with m 1, 6,
    11, 15, 16, 21. Only at equal op times: the handcrafted ZB-V assumes T_F = T_B = T_W (the
    paper's sec. 6)."""
    for p in (2, 3, 4, 8):
        for m in sorted({*range(1, 3 * p + 1, 1 if p < 8 else 5), 2 * p - 1}):
            traces = simulate(p, m, "zb-v", v=2, t_f=1, t_b=1, t_w=1)
            span = max(e.end for t in traces for e in t.events)
            idle = {span - sum(e.end - e.start for e in t.events) for t in traces}
            assert idle == {zb_v_idle(p, m)}, (p, m, idle)
            assert [peak_inflight(t) for t in traces] == [zb_v_peak(p, m, r) for r in range(p)]
            # every rank runs F, B, W of each of its two chunks for every micro-batch
            assert all(len(t.events) == 6 * m for t in traces), (p, m)


@pytest.mark.parametrize(
    "rank, move, error",
    [
        # rank 0 (7 F0, 4 x F1 B1 W1, F0 B0 ...): B0 0 moved second waits for rank 1's B0 0, which
        # runs after rank 1's F0 1, which waits for rank 0's F0 1
        (0, (20, 1), "deadlock"),
        # rank 3, the V's turn: chunk 1's F0 before chunk 0's F0, whose output it takes
        (3, (1, 0), "deadlock"),
        (0, (9, 8), "after"),  # W1 0 before its B1 0
    ],
)
def test_simulator_rejects_a_misordered_zb_v(rank, move, error):
    ops = ops_in_order(schedules.zb_v(4, 0, 8))
    assert ops[:10] == [Op("F", i, 0) for i in range(7)] + [Op(k, 0, 1) for k in "FBW"]
    assert ops_in_order(schedules.zb_v(4, 3, 8))[:2] == [Op("F", 0, 0), Op("F", 0, 1)]
    simulate(4, 8, "zb-v", v=2, t_b=1, t_w=1)  # the schedule itself passes
    with pytest.raises(RuntimeError, match=error):
        simulate(4, 8, zb_dense.moved(schedules.zb_v, rank, move), v=2, t_b=1, t_w=1, place="v")


def test_refusals():
    for virtual in (1, 3):
        with pytest.raises(ValueError, match="needs --pp >= 2 and --virtual-stages 2"):
            pp.check_args(8, 4, 8, "zb-v", virtual)
    with pytest.raises(ValueError, match="needs --pp >= 2 and --virtual-stages 2"):
        pp.check_args(8, 1, 8, "zb-v", 2)
    with pytest.raises(ValueError, match="drop --compile"):
        pp.check_args(8, 4, 8, "zb-v", 2, compiled=True)
    with pytest.raises(ValueError, match="larger than --n-layer"):
        pp.check_args(6, 4, 8, "zb-v", 2)  # 2p chunks need 2p layers
    for m in (1, 3, 7, 9):
        pp.check_args(8, 4, m, "zb-v", 2)  # any micro-batch count (the simulator, above)


# ---------------------------------------------------------------- against the dense model, on gloo
LAYOUTS = [(1, 4, "zb-v", [(8, m) for m in (1, 4, 7)]), (2, 2, "zb-v", [(4, m) for m in (2, 3)])]


def test_zb_v_equals_dense():
    """As ZB-H1's test (tests/zb_dense.py): the first step's gradients bitwise except the tied
    embedding's (on rank 0 its lookup and head halves accumulate per micro-batch, not summed first
    as in the dense backward), losses and weights within 1e-6. The runtime ran the schedule's op
    list and held zb_v_peak chunk micro-batches; every B and W but the rank's last W ran under
    no_sync. Rank 0 holds the embedding, the head and the last layers; no rank holds a copy of the
    tied matrix."""
    results = worlds.launch(zb_dense.dense_world, 4, LAYOUTS, timeout=300)
    ran = zb_dense.check_dense(results, LAYOUTS, {"zb-v": zb_v_peak}, lambda m: 4 * m - 1)
    for (_, _, p, m, rank), r in ran.items():
        n_layer = 2 * p
        ends = {pp.TIED_EMBEDDING, "head.ln_f.weight"} <= r["names"]
        assert ends == (rank == 0), (p, m, rank, r["names"])
        last = f"blocks.{n_layer - 1}.mlp.c_fc.weight" in r["names"]
        assert last == (rank == 0), (p, m, rank)


# ---------------------------------------------------------------- train.py: zb-v against its 1f1b
LLAMA = ["--arch", "llama", "--n-kv-head", "2", "--untie-embeddings"]
TRAINED = [
    # untied (a Llama): every parameter's gradient is 1F1B's, bitwise
    ("llama-pp4-untied", [*LLAMA, "--pp", "4", "--n-layer", "8", "--batch-size", "1",
                          "--grad-accum", "8"], True),
    # and tp 2 + SP with selective recompute: the V's turn hands over a sequence-sharded activation
    ("llama-tp2-sp-pp2-untied", [*LLAMA, "--tp", "2", "--sequence-parallel", "--pp", "2",
                                 "--recompute", "selective", "--batch-size", "2", "--grad-accum",
                                 "4"], True),
    # experts over ep 2 (the all-to-alls of both ranks of an ep group in the V's order), ZeRO-1
    # over dp 2, bf16
    ("llama-moe-ep2-pp2-zero1-bf16", [*LLAMA, "--n-experts", "4", "--top-k", "2", "--ep", "2",
                                      "--pp", "2", "--zero", "1", "--dtype", "bf16",
                                      "--batch-size", "1", "--grad-accum", "4"], True),
    # tied, ZeRO-1 over dp 2: the tied matrix's halves sum in another order (within RTOL)
    ("dp2-pp2-zero1", ["--pp", "2", "--zero", "1", "--batch-size", "1", "--grad-accum", "4"],
     False),
]  # fmt: skip
RUNS = [
    (f"{name}-{schedule}", [*extra, "--schedule", schedule, "--virtual-stages", virtual])
    for name, extra, _ in TRAINED
    for schedule, virtual in (("1f1b", "1"), ("zb-v", "2"))
]


def test_train_zb_v_equals_1f1b(corpus, tmp_path):
    """train.py end to end under --schedule zb-v (build_stage, tied_rule, the loss broadcast from
    rank 0, the global norm, evaluation on the V, the metrics, the checkpoints): untied (pp 4; tp 2
    + SP x pp 2 with selective recompute; experts over ep 2 with ZeRO-1 in bf16), every loss, the
    validation loss and the final weights bitwise 1F1B's; tied with ZeRO-1 over dp 2, within the
    layouts' RTOL (tests/test_layouts.py). ZeRO-2 beside pp is refused for every schedule
    (zero_rules.pipeline_error)."""
    worlds.launch(zb_dense.train_runs, 4, corpus, tmp_path, RUNS, timeout=600)
    for name, _, bitwise in TRAINED:
        if bitwise:
            zb_dense.bitwise_equal(tmp_path, f"{name}-1f1b", f"{name}-zb-v")
            continue
        (a, _), (b, _) = (zb_dense.curves_and_weights(tmp_path, f"{name}-{s}") for s in SCHEDS)
        assert b == pytest.approx(a, rel=RTOL), (name, a, b)
    assert "--pp" in zero_rules.pipeline_error(2, 2)


def test_train_zb_v_dp2_syncs_once_per_step(corpus, tmp_path):
    """dp 2 x pp 2, untied: the V's two chunks share the engine's buckets, so only the rank's last W
    runs synced (pp.py); a synced W per chunk reduced every bucket at the first chunk's end, the
    other chunk's partial sums too, and the weights were 1F1B's only within rounding."""
    flags = [*LLAMA, "--pp", "2", "--batch-size", "1", "--grad-accum", "4"]
    runs = [
        (f"dp2-{s}", [*flags, "--schedule", s, "--virtual-stages", v]) for s, v in zip(SCHEDS, "12")
    ]
    worlds.launch(zb_dense.train_runs, 4, corpus, tmp_path, runs, timeout=300)
    zb_dense.bitwise_equal(tmp_path, "dp2-1f1b", "dp2-zb-v")
