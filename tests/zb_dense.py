"""The zero-bubble tests' helpers, shared by tests/test_zero_bubble.py (ZB-H1, ZB-H2) and
tests/test_zb_v.py (ZB-V): a schedule with one op moved (a misordered variant); a split-backward
schedule on this pipeline stage against the dense model over 3 SGD steps (pp.train_step, gloo);
train.py under a schedule against its 1F1B (the losses, the validation loss and the final weights
from the checkpoints)."""

import contextlib
import copy
import json
from pathlib import Path

import torch

from nanomega import checkpoint, dist, pp, reshard, schedules, train, wgrad
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.schedules import Op, Trace
from test_layouts import COMMON, flags

VOCAB, SEQ, MB, STEPS = 96, 8, 2, 3


def moved(make, rank_moved, move):
    """Schedule `make` with rank_moved's op at position i moved to position j (move = (i, j))."""

    def misordered(p, rank, m, v):
        ops = schedules.ops_in_order(make(p, rank, m, v))
        if rank == rank_moved:
            i, j = move
            ops.insert(j, ops.pop(i))
        return [[op] for op in ops]

    return misordered


def dense_case(grid, n_layer, m, schedule):
    """`schedule` on this stage and the dense model, 3 SGD steps: the largest differences (the
    first step's gradients apart from the tied embedding's, which sums its two halves in another
    order), the op order the runtime ran, its peak in-flight (chunk) micro-batches, how many ops ran
    under no_sync, the parameters this stage holds."""
    torch.manual_seed(0)
    dense = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=n_layer, n_head=2, n_embd=32))
    place = schedules.placement(schedule)
    virtual = 2 if place == "v" else 1
    stage = wgrad.split_backward(pp.build_stage(copy.deepcopy(dense), grid, virtual, place))
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
            virtual=virtual,
            trace=trace,
            no_sync=lambda: no_sync.append(1) or contextlib.nullcontext(),
        )
        pp.sync_tied_grads(stage, grid)  # on the V nothing to sum: rank 0 holds the one matrix
        losses = [dense(x, y) for x, y in batches]
        for lo in losses:
            (lo / m).backward()
        diff["loss"] = max(diff["loss"], abs(loss - torch.stack(losses).mean().item()))
        for name, p in stage.named_parameters():
            d = (p.grad - dense_params[pp.saved_name(name, p)].grad).abs().max().item()
            tied = p is pp.tied_embedding(stage, grid) or (
                place == "v" and name == pp.TIED_EMBEDDING
            )
            key = "grad_step1" if step == 0 and not tied else "grad"
            diff[key] = max(diff[key], d)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for name, p in stage.named_parameters():
        d = (p - dense_params[pp.saved_name(name, p)]).abs().max().item()
        diff["weight"] = max(diff["weight"], d)
    ran = [Op(e.op, e.mb, e.chunk) for e in trace.events]
    names = {name for name, _ in stage.named_parameters()}
    return dict(diff=diff, ran=ran, inflight=trace.peak_inflight, no_sync=len(no_sync), names=names)


def dense_world(layouts):
    """Every layout (dp, pp, schedule, [(n_layer, m), ...]) on this rank: (pp rank, results)."""
    return [
        (dist.Grid(dp, p, 1).pp_rank, [dense_case(dist.Grid(dp, p, 1), n, m, s) for n, m in cases])
        for dp, p, s, cases in layouts
    ]


def check_dense(results, layouts, peaks, no_sync):
    """The dense_world results: the first step's gradients bitwise (every op the dense model's, in
    its order), losses, gradients and weights within 1e-6; the runtime ran the schedule's op list
    and held peaks[schedule](p, m, rank) micro-batches; no_sync(m) ops per step ran under no_sync (all but the
    rank's last W: the buckets reduce there). Returns the results by layout and rank."""
    out = {}
    for rank_results in results:
        for (dp, p, schedule, cases), (rank, case_results) in zip(layouts, rank_results):
            for (_, m), r in zip(cases, case_results):
                where, d = f"{schedule} dp={dp} p={p} m={m} pp_rank={rank}", r["diff"]
                assert d["grad_step1"] == 0.0 and d["loss"] <= 1e-6, (where, d)
                assert d["grad"] <= 1e-6 and d["weight"] <= 1e-6, (where, d)
                make = schedules.SCHEDULES[schedule]
                assert r["ran"] == schedules.ops_in_order(make(p, rank, m)), where
                assert r["inflight"] == peaks[schedule](p, m, rank), where
                assert r["no_sync"] == STEPS * no_sync(m), where
                out[(schedule, dp, p, m, rank)] = r
    return out


def train_runs(corpus, root, runs):
    """train.main for every (name, flags) of runs, out-dirs under root (one world: worlds.launch)."""
    for name, extra in runs:
        train.main(flags(corpus, Path(root) / name, extra))
    return True


def curves_and_weights(root, name):
    """A run's losses and its validation loss (a list), and its final weights by dense name."""
    recs = [json.loads(line) for line in open(Path(root) / name / "metrics.jsonl")]
    curve = [r["loss"] for r in recs if "loss" in r] + [recs[-1]["val_loss"]]
    steps = int(COMMON[COMMON.index("--max-steps") + 1])
    assert len(curve) == steps + 1, (name, curve)
    return curve, reshard.full_weights(checkpoint.latest(Path(root) / name))


def bitwise_equal(root, a, b):
    """Runs a and b: every loss, the validation loss and every final weight equal bitwise."""
    (curve_a, weights_a), (curve_b, weights_b) = (curves_and_weights(root, n) for n in (a, b))
    assert curve_a == curve_b, (a, b, curve_a, curve_b)
    assert weights_a.keys() == weights_b.keys(), (a, b)
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a), (a, b)
