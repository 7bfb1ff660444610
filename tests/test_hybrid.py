"""Hybrid sharding (HSDP, issue 46): ZeRO-1/2/3 sharded over a shard group of 2 neighbouring ranks
(inside a host) and replicated over 2 (across hosts), in a world of 4 (nanomega/zero.py,
zero_rules.Replicas.replicate, dist.layout's dp_shard / dp_rep).

Bitwise against one process that sums the micro-batch gradients in the engine's hybrid order:
inside each shard group as test_zero's 2-rank world does (ZeRO-1: each rank's micro-batches, then
the 2 ranks; ZeRO-2/3: the 2 ranks of each micro-batch, then the micro-batches), then the two
groups' sums (the all-reduce across). Each of these is a two-term sum, exact in either operand
order, and / 4 is exact: the math guarantees the same bits.
Against plain ZeRO at dp 4, a tolerance: gloo's 4-rank ring adds the four ranks in an order of its
own, not (a + b) + (c + d). That is test_zero's 3-rank situation, and its bound ABS (1% of one lr
step; a wrong shard, offset or a missing replicate sum moves weights by ~lr) is the bound here.
Bytes: per step, through the shard axis (dps) and the replicate axis (dpr) as CommLog counts them,
= formulas.hybrid_comm_bytes exactly. Checkpoints: the engine's state by name moves between the
hybrid and the plain layout both ways (engine level, here) and train.py's checkpoint files between
2 x 2, dp 4 and one process (test_checkpoints_reshard_to_and_from_hybrid).
"""

import io
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as td

from nanomega import checkpoint, dist, formulas, reshard, train, worlds
from nanomega.job import checks
from nanomega.job import flags as job_flags
from nanomega.dist import RING
from nanomega.zero_rules import Replicas
import test_layouts
from test_layouts import RTOL, curve, flags
from test_zero import ABS, ACCUM, STEPS, _bitwise, _engine, _maxdiff, _reference, _train, _weights

pytestmark = pytest.mark.usefixtures("one_thread")
STAGES = (1, 2, 3)
ORDER = {1: "ranks_last", 2: "mb_last", 3: "mb_last"}
CORPUS_CHARS = 200_000  # of the embedded corpus, for conftest's `corpus`
dense = test_layouts.dense  # the fixture: the one-process run every curve is held against


def test_layout_puts_a_shard_group_inside_a_host_and_its_replicas_across():
    """dist.layout(dp_shard=S): the shard groups (S x tp neighbouring ranks: one host of tp S) and
    the replicate groups (one rank per host) partition the world, together span dp_cp, and a rank's
    own groups (meta.PaperGrid's path) are the whole layout's; S = dp: dp_shard is dp_cp."""
    dp, tp, S = 8, 2, 4
    whole = {k: [g.tolist() for g in v] for k, v in dist.layout(dp, 1, tp, dp_shard=S).items()}
    for attr, size in (("dp_shard", S), ("dp_rep", dp // S)):
        assert sorted(r for g in whole[attr] for r in g) == list(range(dp * tp)), attr
        assert {len(g) for g in whole[attr]} == {size}, attr
    host = tp * S  # ranks per host
    assert all(len({r // host for r in g}) == 1 for g in whole["dp_shard"])
    assert all(len({r // host for r in g}) == len(g) for g in whole["dp_rep"])
    for g in whole["dp_cp"]:  # shard x replicate = the weights' replicas
        assert sorted(r for s in whole["dp_shard"] if s[0] in g for r in s) == sorted(g)
    for rank in range(dp * tp):
        mine = dist.layout(dp, 1, tp, rank=rank, dp_shard=S)
        for attr in ("dp_shard", "dp_rep"):
            assert [g.tolist() for g in mine[attr]] == [g for g in whole[attr] if rank in g]
    plain = dist.layout(dp, 1, tp)
    assert [g.tolist() for g in plain["dp_shard"]] == [g.tolist() for g in plain["dp_cp"]]


def test_dry_run_prices_the_links_refuses_bad_shards(capsys):
    """--dry-run at --world 8 --dp-shard 4, ZeRO-3, fp32, m = 2: per step inside (S - 1)/S x 3m
    passes of 4 bytes = 18 bytes per (padded) parameter, across 2 (R - 1)/R / S x 4 = 1, plain ZeRO
    over dp 8 7/8 x 24 = 21. And what hybrid sharding cannot run, one line each."""
    base = ["--world", "8", "--zero", "3", "--batch-size", "1", "--grad-accum", "2"]
    res = train.main([*base, "--dp-shard", "4", "--dry-run"])
    (inside, across), plain = res["links"]
    assert inside == pytest.approx(18 * across) and plain == pytest.approx(21 * across)
    assert "across hosts" in capsys.readouterr().out
    assert train.main([*base, "--dry-run"])["links"] is None  # off: nothing hybrid printed
    for extra, match in [
        (["--dp-shard", "3"], "--dp-shard 3 must divide dp 8"),
        (["--dp-shard", "2", "--zero", "0"], "--dp-shard 2 with --zero 0"),
        (["--dp-shard", "2", "--cp", "2"], "built and tested for tp x dp layouts only"),
    ]:
        with pytest.raises(ValueError, match=match) as error:
            checks.check(job_flags.parse([*base, *extra, "--dry-run"]))
        assert "\n" not in str(error.value)


def _hybrid(grid, stage, **kw):
    replicas = [Replicas("dense", grid.dp_shard, replicate=grid.dp_rep)]
    return _engine(grid, "gpt", stage, replicas=replicas, **kw)


def _exported(engine):
    """(name, start, end) of every piece this rank's checkpoint would hold."""
    return [(p["name"], p["start"], p["end"]) for p in reshard.export_by_name(engine)]


def _world():
    grid, res = dist.Grid(4, 1, 1, dp_shard=2), {}
    res["axes"] = (grid.dp_shard.ranks, grid.dp_rep.ranks)
    for stage in STAGES:
        engine, _, outs = _train(_hybrid(grid, stage), "gpt", 0, STEPS)
        n = sum(g.padded for g in engine.groups)  # the last step's traffic is in the log
        inside = sum(
            RING[op](2) * grid.log.bytes(op, "dps") for op in ("reduce_scatter", "all_gather")
        )
        r = res[stage] = dict(
            norms=[o["grad_norm"] for o in outs],
            inside=inside,
            across=grid.log.wire_bytes("dpr"),
            formula=formulas.hybrid_comm_bytes(n, stage, 2, 2, 4, 4, ACCUM),
            weights=_weights(engine),
            exported=grid.all.all_gather_object(_exported(engine)),
        )

        # plain ZeRO over the 4 ranks, and the state moved both ways after STEPS - 1 steps
        plain, _, plain_outs = _train(_engine(grid, "gpt", stage), "gpt", 0, STEPS - 1)
        from_plain = reshard.full_state(plain)
        _train(plain, "gpt", STEPS - 1, 1)
        r.update(plain=_weights(plain), plain_norms=[o["grad_norm"] for o in plain_outs])
        hybrid = _train(_hybrid(grid, stage), "gpt", 0, STEPS - 1)[0]
        from_hybrid = reshard.full_state(hybrid)
        moved = _hybrid(grid, stage, seed=1)
        reshard.import_by_name(moved, *from_plain)
        r["plain_to_hybrid"] = _weights(_train(moved, "gpt", STEPS - 1, 1)[0])
        moved = _engine(grid, "gpt", stage, seed=1)
        reshard.import_by_name(moved, *from_hybrid)
        r["hybrid_to_plain"] = _weights(_train(moved, "gpt", STEPS - 1, 1)[0])
        r["from"] = (from_plain, from_hybrid)
    buf = io.BytesIO()  # tensors through the result queue as bytes (a rank may exit before they
    torch.save(res, buf)  # are read: shared tensors would go with it)
    return buf.getvalue()


@pytest.fixture(scope="module")
def world4():
    return [torch.load(io.BytesIO(b)) for b in worlds.launch(_world, 4, timeout=600)]


def test_groups_are_neighbours_inside_and_strided_across(world4):
    """dp index d = r x S + s: the shard group is S neighbouring ranks (one host), the replicate
    group the ranks with the same s (one per host)."""
    assert [rank["axes"] for rank in world4] == [
        ([0, 1], [0, 2]),
        ([0, 1], [1, 3]),
        ([2, 3], [0, 2]),
        ([2, 3], [1, 3]),
    ]


@pytest.mark.parametrize("stage", STAGES)
def test_hybrid_equals_one_process_bitwise_and_plain_zero_within_the_layout_tolerance(
    world4, stage
):
    r = world4[0][stage]
    ref, norms = _reference("gpt", 4, STEPS, ORDER[stage], shard=2)
    assert _bitwise(r["weights"], ref) == [], _maxdiff(r["weights"], ref)
    assert max(abs(a - b) / b for a, b in zip(r["norms"], norms)) < 1e-12
    # every rank holds the same weights: the replicas across stayed equal
    assert all(_bitwise(rank[stage]["weights"], ref) == [] for rank in world4)
    # plain ZeRO at dp 4: gloo's 4-rank ring adds in an order of its own (the docstring)
    assert _maxdiff(r["plain"], r["weights"]) <= ABS
    assert max(abs(a - b) / b for a, b in zip(r["plain_norms"], norms)) < 1e-6


@pytest.mark.parametrize("stage", STAGES)
def test_bytes_inside_and_across_are_the_formula(world4, stage):
    for rank in world4:
        r = rank[stage]
        assert (r["inside"], r["across"]) == pytest.approx(r["formula"], rel=1e-12)
        assert r["across"] > 0


@pytest.mark.parametrize("stage", STAGES)
def test_each_parameter_is_saved_once_across_the_replicas(world4, stage):
    """export_by_name: the shard group at replicate index 0 saves; its copies across save nothing,
    and the pieces cover every element of every parameter exactly once."""
    every = [p for pieces in world4[0][stage]["exported"] for p in pieces]
    assert [] == [p for pieces in world4[0][stage]["exported"][2:] for p in pieces]
    shapes = {k: v.numel() for k, v in world4[0][stage]["weights"].items()}
    for name, size in shapes.items():
        ranges = sorted((a, b) for k, a, b in every if k == name)
        assert ranges[0][0] == 0 and ranges[-1][1] == size, name
        assert all(b == a for (_, b), (a, _) in zip(ranges, ranges[1:])), name


@pytest.mark.parametrize("stage", STAGES)
def test_state_moves_between_hybrid_and_plain_zero_both_ways(world4, stage):
    """Plain dp 4 -> hybrid: the next step bitwise one process's in the hybrid order from the moved
    state; hybrid -> plain dp 4: within ABS of it (gloo's 4-rank order)."""
    r = world4[0][stage]
    from_plain, from_hybrid = r["from"]
    ref = _reference("gpt", 4, 1, ORDER[stage], (*from_plain, STEPS - 1), shard=2)[0]
    assert _bitwise(r["plain_to_hybrid"], ref) == []
    ref = _reference("gpt", 4, 1, ORDER[stage], (*from_hybrid, STEPS - 1), shard=2)[0]
    assert _maxdiff(r["hybrid_to_plain"], ref) <= ABS


HYBRID = ["--batch-size", "1", "--grad-accum", "2", "--zero", "3", "--dp-shard", "2"]
PLAIN = ["--batch-size", "1", "--grad-accum", "2", "--zero", "3"]
# tp 2 x dp 2 as shard 1 x replicate 2: the replicate path alone, beside tensor parallelism
TP2 = ["--tp", "2", "--batch-size", "2", "--grad-accum", "2", "--zero", "2", "--dp-shard", "1"]


def _copy(root, source, step, out):
    """OUT/ckpt holding only `source`'s checkpoint of `step` (rank 0 copies; all wait)."""
    if not td.is_initialized() or td.get_rank() == 0:
        name = f"step_{step:06d}"
        (out / "ckpt").mkdir(parents=True)
        shutil.copytree(Path(root) / source / "ckpt" / name, out / "ckpt" / name)
        (out / "ckpt" / "latest").write_text(name)
    if td.is_initialized():
        td.barrier()


def _checkpoints(corpus, root, one):
    """In a world of 4: a 2 x 2 hybrid ZeRO-3 run and a tp 2 one (TP2); the one-process run's step 2
    resumed at 2 x 2; the hybrid step 2 resumed at plain dp 4 (saving step 3); that step 3 resumed
    at 2 x 2 ZeRO-1."""
    root = Path(root)
    train.main(flags(corpus, root / "hybrid", HYBRID))
    train.main(flags(corpus, root / "tp2-shard1x2", TP2))
    for source, step, name, extra in [
        (one, 2, "dense-to-hybrid", HYBRID),
        (root / "hybrid", 2, "hybrid-to-dp4", [*PLAIN, "--save-every", "1"]),
        (root / "hybrid-to-dp4", 3, "dp4-to-hybrid", [*PLAIN[:-1], "1", "--dp-shard", "2"]),
    ]:
        _copy(Path(source).parent, Path(source).name, step, root / name)
        train.main(flags(corpus, root / name, [*extra, "--resume"]))
    return checkpoint.read_manifest_json(root / "hybrid" / "ckpt" / "step_000002")


def test_checkpoints_reshard_to_and_from_hybrid(corpus, dense, tmp_path):
    """train.py's checkpoint files: saved at 2 x 2 and resumed at dp 4 and at one process; saved at
    one process and at dp 4 and resumed at 2 x 2. Every curve continues the one-process run's
    (test_layouts' RTOL: a layout changes only the order of sums)."""
    manifest = worlds.launch(_checkpoints, 4, corpus, tmp_path, dense, timeout=600)[0]
    assert manifest["layout"]["dp_shard"] == 2 and manifest["layout"]["dp"] == 4
    _copy(tmp_path, "hybrid", 2, tmp_path / "hybrid-to-1")
    one = ["--batch-size", "2", "--grad-accum", "4", "--resume"]
    train.main(flags(corpus, tmp_path / "hybrid-to-1", one))
    ref, ref_val = curve(dense)
    for name in ("hybrid", "tp2-shard1x2"):
        losses, val = curve(tmp_path / name)
        assert losses == pytest.approx(ref, rel=RTOL) and val == pytest.approx(ref_val, rel=RTOL)
    for name, first in [
        ("dense-to-hybrid", 2),
        ("hybrid-to-dp4", 2),
        ("dp4-to-hybrid", 3),
        ("hybrid-to-1", 2),
    ]:
        losses, val = curve(tmp_path / name)
        assert losses == pytest.approx(ref[first:], rel=RTOL), name
        assert val == pytest.approx(ref_val, rel=RTOL), name
    a = reshard.full_weights(checkpoint.latest(tmp_path / "dp4-to-hybrid"))
    b = reshard.full_weights(checkpoint.latest(dense))
    for k in a:  # test_layouts' bound: 3% of one Adam step at lr 3e-3
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4)
