"""The grid's process groups (nanomega/dist.py) and the trainer's process group at exit
(nanomega/train.py).

- A one-rank axis makes no process group: with NCCL and device_id bound, each would be a
  communicator never used. Its collectives stay local (and uncounted) as before; groups of
  2..world-1 ranks get the world's timeout.
- train.main destroys the process group it started, after a clean end; a launcher's group is left to
  it. dist.shutdown puts a barrier first: without it test_multinode.py's two-host runs aborted at
  exit (gloo).
"""

import datetime

import pytest
import torch
import torch.distributed as td

from nanomega import dist, train, worlds
from nanomega.job import lifecycle

pytestmark = pytest.mark.usefixtures("one_thread")
CORPUS_CHARS = 50_000  # of the embedded corpus, for conftest's `corpus`
LAYOUTS = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 1)]
# (dp, pp, tp, cp, ep): world 4
CP_EP = [(2, 1, 1, 2, 1), (2, 1, 1, 2, 2), (4, 1, 1, 1, 2), (4, 1, 1, 1, 4)]


@pytest.mark.parametrize(
    "dp,pp,tp,cp,ep", [(4, 2, 2, 2, 2), (2, 3, 1, 2, 1), (8, 1, 2, 1, 4), (2, 2, 2, 2, 2)]
)
def test_layout_partitions_the_world(dp, pp, tp, cp, ep):
    """Every axis's groups partition the world into groups of its size; dp_cp is dp and cp together;
    an ep group lies inside a dp group, and an edp group meets each ep group of its dp_cp group in
    exactly one rank."""
    world, groups = (
        dp * pp * cp * tp,
        {a: [s.tolist() for s in v] for a, v in dist.layout(dp, pp, tp, cp, ep).items()},
    )
    sizes = dict(tp=tp, cp=cp, pp=pp, dp=dp, dp_cp=dp * cp, ep=ep, edp=dp * cp // ep)
    for attr, size in sizes.items():
        assert sorted(r for g in groups[attr] for r in g) == list(range(world)), attr
        assert {len(g) for g in groups[attr]} == {size}, attr
    rank = torch.arange(world).view(dp, pp, cp, tp)
    for g in groups["dp_cp"]:
        assert (
            sorted(g) == sorted(r for d in groups["dp"] for r in d if d[0] in g)
            and len(g) == dp * cp
        )
    for e in groups["ep"]:
        assert any(set(e) <= set(d) for d in groups["dp"])
        assert all(len(set(e) & set(x)) <= 1 for x in groups["edp"])
    assert groups["tp"][0] == rank[0, 0, 0, :].tolist()  # tp fastest: neighbours


def _cp_ep_world():
    """The cp and ep axes of 4 ranks: their ranks, and which process groups are shared."""
    made, real = [], td.new_group
    td.new_group = lambda ranks=None, **kw: made.append(sorted(ranks)) or real(ranks, **kw)
    out = {}
    for layout in CP_EP:
        made.clear()
        g = dist.Grid(*layout)
        out[layout] = (
            list(made),
            {
                a: (getattr(g, a).name, getattr(g, a).ranks)
                for a in ("dp", "cp", "dp_cp", "ep", "edp")
            },
            g.ep.group is g.dp.group,
            g.edp is g.dp_cp,
        )
        # a step-boundary vote (save, stop, spike) reaches every rank: rank 3 alone says yes (a cp
        # neighbour)
        out["votes", layout] = [
            lifecycle.grid_agrees(g, g.rank == 3),
            lifecycle.grid_agrees(g, False),
        ]
    # all_to_all with uneven splits over ep = 4: rank r sends (r + i) % 3 + 1 rows of 3 floats to
    # rank i
    r, splits = g.rank, [(g.rank + i) % 3 + 1 for i in range(4)]
    t = torch.cat([torch.full((n, 3), 100.0 * r + i) for i, n in enumerate(splits)])
    # symmetric: i sends me what I send i
    got = g.ep.all_to_all(torch.empty(sum(splits), 3), t, splits, splits)
    out["a2a"] = (
        got[:, 0].tolist(),
        [100.0 * i + r for i, n in enumerate(splits) for _ in range(n)],
        g.log.bytes("all_to_all", "ep"),
        (sum(splits) - splits[r]) * 12,
    )
    return out


def _groups_world():
    """Every layout of 4 ranks: the groups new_group made (their ranks); for each axis its size,
    whether it has a group, an all-reduce, an all-gather and an object gather of the ranks, and what
    the log counted; the timeout of this rank's tp group when that is a sub-group."""
    made, real = [], td.new_group
    # counting
    td.new_group = lambda ranks=None, **kw: made.append(sorted(ranks)) or real(ranks, **kw)
    out = {}
    for layout in LAYOUTS:
        made.clear()
        grid = dist.Grid(*layout)
        grid.log.reset()
        axes = {}
        # embed: None on middle pipeline stages
        for axis in (grid.dp, grid.pp, grid.tp, grid.embed):
            if axis is not None:
                mine = torch.full((4,), float(grid.rank))
                axes[axis.name] = dict(
                    size=axis.size,
                    ranks=axis.ranks,
                    no_group=axis.group is None,
                    sum=axis.all_reduce(mine.clone())[0].item(),
                    gathered=axis.all_gather(torch.empty(4 * axis.size), mine)[::4].tolist(),
                    objects=axis.all_gather_object(grid.rank),
                )
        tp = (
            grid.tp.group._get_backend(torch.device("cpu")).options._timeout
            if 1 < grid.tp.size < 4
            else None
        )
        out[layout] = (list(made), axes, {k: list(v) for k, v in grid.log.counts.items()}, tp)
    return out


def test_one_rank_axes_make_no_process_group():
    """Before: 12 new_group calls for (4, 1, 1) (tp, pp and the embedding's four one-rank slices
    each), now 0; and (1, 2, 2) makes 4, not 6 (its embedding groups are its pipeline groups: no
    second communicator)."""
    results = worlds.launch(_groups_world, 4, timeout=300)
    for out in results:
        for (dp, pp, tp), (made, axes, counts, timeout) in out.items():
            # one group per distinct set of ranks: pp = 2's embedding groups are its pipeline groups
            wanted = {
                tuple(s.tolist())
                for sl in dist.layout(dp, pp, tp).values()
                for s in sl
                if 1 < len(s) < 4
            }
            assert sorted(map(tuple, made)) == sorted(wanted), ((dp, pp, tp), made)
            assert all(1 < len(g) < 4 for g in made)  # one rank: no group; all four: WORLD
            for name, a in axes.items():
                assert a["no_group"] == (a["size"] == 1), (name, a)
                # the same results with or without a group: a one-rank axis returns its own values
                assert (
                    a["sum"] == sum(a["ranks"]) and a["gathered"] == a["ranks"] == a["objects"]
                ), (name, a)
                if a["size"] > 1:  # counted as before; nothing for a one-rank axis
                    assert counts[("all_reduce", name, "float32")] == [1, 16]
                    assert counts[("all_gather", name, "float32")] == [1, 16 * a["size"]]
            assert {axis for _, axis, _ in counts} == {n for n, a in axes.items() if a["size"] > 1}
            if timeout is not None:
                # the world's (worlds.launch), not gloo's 30 min
                assert timeout == datetime.timedelta(seconds=120)


def test_cp_and_ep_axes():
    """cp = 1 / ep = 1: dp_cp and edp are dp's Axis (its name; ZeRO's byte logs unchanged). ep = dp:
    one group under two names (a second NCCL communicator for the same ranks would never be
    needed)."""
    out = worlds.launch(_cp_ep_world, 4, timeout=120)
    for rank, res in enumerate(out):
        got, want, counted, formula = res.pop("a2a")
        # bytes that leave the rank
        assert got == want and counted == formula, (rank, got, want, counted, formula)
        for layout in CP_EP:
            # the cp ranks vote too
            assert res.pop(("votes", layout)) == [True, False], (rank, layout)
        for (dp, _pp, _tp, cp, ep), (made, axes, shared, edp_is_dpcp) in res.items():
            assert len(made) == len(set(map(tuple, made))), made  # no group twice
            # cp neighbours (tp = 1)
            assert axes["cp"][1] == [r for r in range(4) if r // cp == rank // cp]
            assert (axes["dp_cp"][0] == "dp") == (cp == 1) and edp_is_dpcp == (ep == 1)
            assert (
                axes["ep"][0] == "ep"
                and shared == (ep == dp)
                and len(axes["edp"][1]) == dp * cp // ep
            )
            assert set(axes["ep"][1]) <= set(axes["dp"][1])


def test_train_main_ends_the_process_group_it_started(corpus, tmp_path):
    """torchrun or a plain run: train.main starts the group, so it destroys it after a clean end
    (NCCL warns about communicators left at exit, and a later in-process run would find a stale
    world). A group that was there before (a launcher's: worlds.launch, a test's) is left as it
    was."""
    argv = [
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "16",
        "--block-size",
        "16",
        "--batch-size",
        "2",
        "--max-steps",
        "1",
        "--eval-every",
        "0",
        "--peak-flops",
        "1e11",
        "--device",
        "cpu",
        "--corpus",
        str(corpus),
        "--data-cache",
        str(tmp_path / "cache"),
    ]
    if td.is_initialized():  # left by an earlier in-process test
        td.destroy_process_group()
    train.main([*argv, "--out-dir", str(tmp_path / "own")])
    assert not td.is_initialized()
    dist.init("cpu")  # a launcher's world
    try:
        train.main([*argv, "--out-dir", str(tmp_path / "launched")])
        assert td.is_initialized()
    finally:
        td.destroy_process_group()
