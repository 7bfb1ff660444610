"""ZB-V: two model chunks per rank in a V (schedules.PLACEMENT), the first and the last stage both
on rank 0. The placement table (pure), the schedule as data checked by the simulator against its
bubble and memory (pure), a misordered ZB-V rejected, the refusals; then ZB-V run against the
dense model at pp 2, pp 4 and dp 2 x pp 2, and train.py's zb-v against its 1f1b."""

import contextlib
import copy
import json
from pathlib import Path

import pytest
import torch

from nanomega import checkpoint, dist, pp, reshard, schedules, train, wgrad, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.schedules import Op, Trace, ops_in_order, peak_inflight, simulate
from test_layouts import COMMON, RTOL, flags


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


def _moved(rank_moved, move, schedule=schedules.zb_v):
    """ZB-V (or another schedule) with rank_moved's op at position i moved to position j, one op a
    round."""

    def make(p, rank, m, v):
        ops = ops_in_order(schedule(p, rank, m, v))
        if rank == rank_moved:
            i, j = move
            ops.insert(j, ops.pop(i))
        return [[op] for op in ops]

    return make


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
        simulate(4, 8, _moved(rank, move), v=2, t_b=1, t_w=1, place="v")


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
VOCAB, SEQ, MB, STEPS = 96, 8, 2, 3


def _case(grid, n_layer, m, schedule="zb-v"):
    """ZB-V (or another V schedule) on this stage and the dense model, 3 SGD steps: the largest differences (the first
    step's gradients apart from the tied embedding's), the op order the runtime ran, its peak
    in-flight chunk micro-batches, how many ops ran under no_sync."""
    torch.manual_seed(0)
    dense = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=n_layer, n_head=2, n_embd=32))
    stage = wgrad.split_backward(pp.build_stage(copy.deepcopy(dense), grid, 2, "v"))
    opts = [torch.optim.SGD(mod.parameters(), lr=0.5, momentum=0.9) for mod in (stage, dense)]
    diff, no_sync = {"loss": 0.0, "grad_step1": 0.0, "grad": 0.0, "weight": 0.0}, []
    dense_params = dict(dense.named_parameters())
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
            schedule,
            virtual=2,
            trace=trace,
            no_sync=lambda: no_sync.append(1) or contextlib.nullcontext(),
        )
        pp.sync_tied_grads(stage, grid)  # nothing to sum: rank 0 holds the one matrix
        losses = [dense(x, y) for x, y in batches]
        for lo in losses:
            (lo / m).backward()
        diff["loss"] = max(diff["loss"], abs(loss - torch.stack(losses).mean().item()))
        for name, p in stage.named_parameters():
            d = (p.grad - dense_params[name].grad).abs().max().item()
            key = "grad_step1" if step == 0 and name != pp.TIED_EMBEDDING else "grad"
            diff[key] = max(diff[key], d)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for name, p in stage.named_parameters():
        diff["weight"] = max(diff["weight"], (p - dense_params[name]).abs().max().item())
    ran = [Op(e.op, e.mb, e.chunk) for e in trace.events]
    names = {name for name, _ in stage.named_parameters()}
    return dict(diff=diff, ran=ran, inflight=trace.peak_inflight, no_sync=len(no_sync), names=names)


def _world(layouts):
    return [
        (dist.Grid(dp, p, 1).pp_rank, [_case(dist.Grid(dp, p, 1), n, m) for n, m in cases])
        for dp, p, cases in layouts
    ]


LAYOUTS = [
    (1, 4, [(8, m) for m in (1, 4, 7)]),
    (2, 2, [(4, m) for m in (2, 3)]),
]


def test_zb_v_equals_dense():
    """As ZB-H1's test: the first step's gradients bitwise except the tied embedding's (on rank 0
    its lookup and head halves accumulate per micro-batch, not summed first as in the dense
    backward), losses and weights within 1e-6. The runtime ran the schedule's op list and held
    zb_v_peak chunk micro-batches; every B and W but each chunk's last W ran under no_sync. Rank 0
    holds the embedding, the head and the last layers; no rank holds a copy of the tied matrix."""
    results = worlds.launch(_world, 4, LAYOUTS, timeout=300)
    for rank_results in results:
        for (dp, p, cases), (rank, case_results) in zip(LAYOUTS, rank_results):
            for (n_layer, m), r in zip(cases, case_results):
                where, d = f"dp={dp} p={p} m={m} pp_rank={rank}", r["diff"]
                assert d["grad_step1"] == 0.0 and d["loss"] <= 1e-6, (where, d)
                assert d["grad"] <= 1e-6 and d["weight"] <= 1e-6, (where, d)
                assert r["ran"] == ops_in_order(schedules.zb_v(p, rank, m)), where
                assert r["inflight"] == zb_v_peak(p, m, rank), where
                assert r["no_sync"] == STEPS * (4 * m - 2), where
                ends = {pp.TIED_EMBEDDING, "head.ln_f.weight"} <= r["names"]
                assert ends == (rank == 0), (where, r["names"])
                last = f"blocks.{n_layer - 1}.mlp.c_fc.weight" in r["names"]
                assert last == (rank == 0), where


# ---------------------------------------------------------------- train.py: zb-v against its 1f1b
TRAINED = [
    # untied (a Llama): every parameter's gradient is 1F1B's, bitwise
    ("llama-pp4-untied", ["--arch", "llama", "--n-kv-head", "2", "--untie-embeddings", "--pp", "4",
                          "--n-layer", "8", "--batch-size", "1", "--grad-accum", "8"], True),
    # and tp 2 + SP with selective recompute: the V's turn hands over a sequence-sharded activation
    ("llama-tp2-sp-pp2-untied", ["--arch", "llama", "--n-kv-head", "2", "--untie-embeddings", "--tp",
                                 "2", "--sequence-parallel", "--pp", "2", "--recompute", "selective",
                                 "--batch-size", "2", "--grad-accum", "4"], True),
    # tied, ZeRO-1 over dp 2: the tied matrix's halves sum in another order (within RTOL)
    ("dp2-pp2-zero1", ["--pp", "2", "--zero", "1", "--batch-size", "1", "--grad-accum", "4"],
     False),
]  # fmt: skip


def _train_both(corpus, root):
    for name, extra, _ in TRAINED:
        for schedule, virtual in (("1f1b", "1"), ("zb-v", "2")):
            run = [*extra, "--schedule", schedule, "--virtual-stages", virtual]
            train.main(flags(corpus, Path(root) / f"{name}-{schedule}", run))
    return True


def test_train_zb_v_equals_1f1b(corpus, tmp_path):
    """train.py end to end under --schedule zb-v (build_stage, tied_rule, the loss broadcast from
    rank 0, the global norm, evaluation on the V, the metrics, the checkpoints): untied (pp 4; tp 2
    + SP x pp 2 with selective recompute), every loss, the validation loss and the final weights
    bitwise 1F1B's; tied with ZeRO-1 over dp 2, within the layouts' RTOL (tests/test_layouts.py)."""
    worlds.launch(_train_both, 4, corpus, tmp_path, timeout=600)
    steps = int(COMMON[COMMON.index("--max-steps") + 1])
    for name, _, bitwise in TRAINED:
        curves, weights = [], []
        for schedule in ("1f1b", "zb-v"):
            recs = [
                json.loads(line) for line in open(tmp_path / f"{name}-{schedule}" / "metrics.jsonl")
            ]
            curves.append([r["loss"] for r in recs if "loss" in r] + [recs[-1]["val_loss"]])
            weights.append(reshard.full_weights(checkpoint.latest(tmp_path / f"{name}-{schedule}")))
        assert len(curves[0]) == steps + 1 and weights[0].keys() == weights[1].keys(), name
        if bitwise:
            assert curves[0] == curves[1], (name, curves)
            assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), name
        else:
            assert curves[1] == pytest.approx(curves[0], rel=RTOL), (name, curves)
