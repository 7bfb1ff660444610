"""Build any size: the model on the meta device, and every rank draws only the values it keeps.

Building the dense GPT on every rank and slicing it costs each rank the whole model in fp32; instead
it is built on torch's meta device (shapes, no storage), tensor and pipeline parallelism cut it
there, and each rank draws only the elements of its slices: initialization.draw makes element i
of a dense parameter a function of (seed, name, i) alone, so the values are the dense model's,
sliced.
PaperGrid is rank R's place in a layout without a process group: train.py --dry-run counts its bytes
against the planner's.

Formulas:
    a tp slice (tp.shard_rule: dim d, g interleaved groups) is, for each index of the dims before d
    and each group, one contiguous run of the dense parameter's flat index: `segments`
    a ZeRO-3 flat shard is a range of the local parameters' flat index, i.e. parts of those runs
    drawn by a rank: its own elements (+ the rest of a 2^16-element block at each end of a run); a
    split along dim 1 (the row-parallel c_proj) has a run in every row, so there every block is
    drawn, one at a time
    memory: the rank's share on its device; on the host one local parameter (or ZeRO-3 piece) at
    a time
Lesson: lessons/15-3d-parallelism.md
"""

import math

import torch

from . import dist, pp, tp
from .flat import set_data
from .initialization import draw, init_std


def segments(shape, rule, rank, size):
    """This tp rank's slice of a dense parameter of `shape` as runs (start, length) of the dense
    flat index, in the order of the slice's own flat index. rule: tp.shard_rule's (dim, groups), or
    None (the whole thing). The flat-index form of tp.shard_param (tests/test_meta.py holds the two
    equal for every rule and rank)."""
    n = math.prod(shape)
    if rule is None or size == 1:
        return [(0, n)]
    dim, groups = rule
    outer, d, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    part = d // (groups * size)  # rows of one group this rank holds
    return [
        ((o * d + j * (d // groups) + rank * part) * inner, part * inner)
        for o in range(outer)
        for j in range(groups)
    ]


class Init:
    """The dense model's initialization (initialization.init_std, initialization.draw) as seen
    by one tensor-parallel rank."""

    def __init__(self, cfg, seed, tp_rank=0, tp_size=1):
        self.cfg, self.seed, self.tp_rank, self.tp_size = cfg, seed, tp_rank, tp_size

    def values(self, name, p, start=0, stop=None):
        """Elements [start, stop) of the flattened local parameter p (named `name` in this rank's
        model), fp32 on the host: the same elements of the dense parameter's slice, bitwise."""
        # the last stage's copy of the tied embedding draws the embedding
        dense = pp.saved_name(name, p)
        rule = tp.shard_rule(dense) if tp.is_tensor_parallel(p) else None
        shape = list(p.shape)
        if rule is not None:
            shape[rule[0]] *= self.tp_size

        std = init_std(dense, self.cfg.n_layer)
        stop = p.numel() if stop is None else stop
        out, at = torch.empty(stop - start, device="cpu"), 0

        for first, n in segments(shape, rule, self.tp_rank, self.tp_size):
            lo, hi = max(start, at), min(stop, at + n)  # the part of this run in [start, stop)
            if lo < hi:
                out[lo - start : hi - start] = draw(
                    self.seed, dense, std, first + lo - at, first + hi - at
                )
            at += n
            if at >= stop:
                break
        return out


@torch.no_grad()
def materialize(model, init, device, params=True):
    """A model built on meta, given its values on `device`: every parameter still on meta drawn
    (init.values), one at a time; every buffer moved. params=False: buffers only (the engine draws
    the parameters itself)."""
    device = torch.device(device)
    if device.type == "meta":
        return model
    if params:
        for name, p in model.named_parameters():  # a tied parameter once
            if p.is_meta:
                data = torch.empty(p.shape, dtype=p.dtype, device=device)
                data.view(-1).copy_(init.values(name, p))
                set_data(p, data)
    for module in model.modules():
        for key, buf in list(module.named_buffers(recurse=False)):
            setattr(module, key, buf.to(device))
    return model


class PaperAxis:
    """One axis of a PaperGrid: its size and this rank's place in it. It has no process group:
    asking it for a collective raises (a dry run builds; it never trains)."""

    def __init__(self, name, ranks, rank):
        # (tolist: a million ranks in a moment, not one tensor element at a time)
        self.name = name
        self.ranks = ranks.tolist() if torch.is_tensor(ranks) else [int(r) for r in ranks]
        self.size, self.rank = len(self.ranks), self.ranks.index(rank)

    def __getattr__(self, op):
        raise RuntimeError(
            f"{op} on the {self.name} axis of a PaperGrid: a dry run has no process group"
        )


class PaperGrid:
    """Rank `rank` of a (dp, pp, cp, tp) layout as dist.Grid lays it out (dist.layout), without
    torch.distributed: what building one rank of a 1,000-GPU job on a laptop needs. device: meta
    (nothing allocated), or a real one to build that rank's values (tests: the build needs no
    collective but the replicas' check, which ddp.start_equal skips on meta)."""

    def __init__(self, dp, pp, tp, rank, device="meta", cp=1, ep=1, dp_shard=None):
        world = dp * pp * cp * tp
        if not 0 <= rank < world:
            raise ValueError(
                f"--rank {rank} is outside the {world} ranks of dp {dp} x pp {pp} x cp {cp} x tp {tp}"
            )

        dist.check_layout(world, dp, pp, tp, cp, ep, dp_shard)
        self.world, self.rank, self.device = world, rank, torch.device(device)

        for attr, slices in dist.layout(dp, pp, tp, cp, ep, rank, dp_shard).items():
            # embed: only the end stages have one
            mine = next((s for s in slices if rank in s.tolist()), None)
            name = "dp" if attr == "dp_cp" and cp == 1 else dist.SHORT.get(attr, attr)
            setattr(self, attr, PaperAxis(name, mine, rank) if mine is not None else None)

        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = (
            self.dp.rank,
            self.pp.rank,
            self.cp.rank,
            self.tp.rank,
        )
        self.all = PaperAxis("all", range(world), rank)
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == pp - 1

    def __repr__(self):
        """--dry-run's header: rank R of tp T x pp P [x cp C] x dp D [(shard S x R)] [(ep E)] (tp
        t, stage p[, cp c], dp d[, ep e])."""
        cp, ep = self.cp.size > 1, self.ep.size > 1
        return (
            f"rank {self.rank} of tp {self.tp.size} x pp {self.pp.size}"
            + f" x cp {self.cp.size}" * cp
            + f" x dp {self.dp.size}"
            + f" (shard {self.dp_shard.size} x {self.dp_rep.size})" * (self.dp_rep.size > 1)
            + f" (ep {self.ep.size})" * ep
            + f" (tp {self.tp_rank}, stage {self.pp_rank}"
            + f", cp {self.cp_rank}" * cp
            + f", dp {self.dp_rank}"
            + f", ep {self.ep.rank}" * ep
            + ")"
        )
