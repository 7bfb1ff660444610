"""The rank grid and the one layer every collective goes through.

`world = dp * pp * cp * tp` ranks laid out as `arange(world).view(dp, pp, cp, tp)` (`layout`):
tensor parallel ranks are neighbours, then context parallel, pipeline stages, and data parallel
outermost; expert parallel groups are carved out of dp; hybrid sharding splits the weights'
replicas (dp x cp) into a shard group (S neighbouring dp ranks, inside a host) and a replicate
group (across hosts). Each axis gets its own process group,
wrapped in an `Axis` whose collectives record (op, axis, dtype, bytes) in a `CommLog`, so lessons
and tests can hold measured traffic against formulas. Device and backend are chosen here only: nccl
on CUDA, gloo on CPU.

Bytes one rank sends for a collective over n ranks on a ring, for a tensor of B bytes:
    all_reduce 2(n-1)/n * B      reduce_scatter (n-1)/n * B_in      all_gather (n-1)/n * B_out
    all_to_all: the rows it addresses to the other ranks (B (n-1)/n for equal splits)
Lessons: lessons/04-data-parallel-and-zero.md (the formulas),
         lessons/15-3d-parallelism.md (the grid).
"""

import datetime
import os
import pickle
import socket
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# One-tensor collectives: newer torch (2.13 here) names them all_gather_single /
# reduce_scatter_single (pytorch#186123; the old names stay as deprecated wrappers); torch 2.11 and
# older have only all_gather_into_tensor / reduce_scatter_tensor. Resolved once here, the newer name
# first.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

RING = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    # all_to_all: sent bytes
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
    "all_to_all": lambda n: 1.0,
}


@dataclass
class CommLog:
    """Per-rank traffic: (op, axis, dtype) -> [calls, tensor bytes]. `wire_bytes` applies
    the ring factors."""

    counts: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    sizes: dict = field(default_factory=dict)  # axis name -> ranks in it

    def record(self, op, axis, n, tensor, nbytes=None):  # nbytes: of the tensor, unless said
        self.sizes[axis] = n
        entry = self.counts[(op, axis, str(tensor.dtype).replace("torch.", ""))]
        entry[0] += 1
        entry[1] += tensor.numel() * tensor.element_size() if nbytes is None else nbytes

    def bytes(self, op=None, axis=None) -> int:
        return sum(
            b for (o, a, _), (_, b) in self.counts.items() if op in (None, o) and axis in (None, a)
        )

    def wire_bytes(self, axis=None) -> float:
        return sum(
            RING[o](self.sizes[a]) * b
            for (o, a, _), (_, b) in self.counts.items()
            if axis in (None, a)
        )

    def reset(self):
        self.counts.clear()

    def table(self) -> str:
        rows = [
            f"{op:>14} {axis:>3} {dt:>8} x{c:<5} {b / 2**20:10.3f} MiB"
            for (op, axis, dt), (c, b) in sorted(self.counts.items())
        ]
        return "\n".join(rows)


class Axis:
    """One axis of the grid: its process group (None on one rank), this rank's place in it, counted
    collectives."""

    def __init__(self, name, group, ranks, rank, log):
        self.name, self.group, self.ranks, self.log = name, group, list(ranks), log
        self.size, self.rank = len(self.ranks), self.ranks.index(rank)

    def _count(self, op, t):
        if self.size > 1:
            self.log.record(op, self.name, self.size, t)
        return self.size > 1

    def all_reduce(self, t, op=dist.ReduceOp.SUM):
        if self._count("all_reduce", t):
            dist.all_reduce(t, op=op, group=self.group)
        return t

    def all_gather(self, out, t):  # out: (size * t.shape[0], ...) contiguous
        if self._count("all_gather", out):
            ALL_GATHER_SINGLE(out, t, group=self.group)
        else:
            out.copy_(t)
        return out

    def reduce_scatter(self, out, t):  # t: (size * out.shape[0], ...) contiguous, summed then split
        if self._count("reduce_scatter", t):
            REDUCE_SCATTER_SINGLE(out, t, group=self.group)
        else:
            out.copy_(t)
        return out

    def start(self, op, out, t=None):
        """all_reduce(out), all_gather(out, t) or reduce_scatter(out, t) launched without waiting,
        counted as the blocking ones: returns a Work to .wait() on, or None on a one-rank axis (out
        is already done). ZeRO overlaps its gradient reduction with backward, and its parameter
        prefetch with compute, this way."""
        if not self._count(op, t if op == "reduce_scatter" else out):
            if t is not None:
                out.copy_(t)
            return None
        if op == "all_reduce":
            return dist.all_reduce(out, group=self.group, async_op=True)
        collective = ALL_GATHER_SINGLE if op == "all_gather" else REDUCE_SCATTER_SINGLE
        return collective(out, t, group=self.group, async_op=True)

    def broadcast(self, t, src_index=0, wait=True):
        """t from the rank at src_index; wait=False: (t, a Work to .wait() on, or None)."""
        work = None
        if self._count("broadcast", t):
            work = dist.broadcast(t, src=self.ranks[src_index], group=self.group, async_op=not wait)
        return t if wait else (t, work)

    def barrier(self):
        if self.size > 1:
            dist.barrier(group=self.group)

    def all_gather_object(self, obj):
        """[every rank's obj] in axis order (pickled; for metadata), counted as an all-gather of the
        largest pickle."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        self.log.record(
            "all_gather",
            self.name,
            self.size,
            torch.empty(self.size * max(len(pickle.dumps(o)) for o in out), dtype=torch.uint8),
        )
        return out

    def p2p(self, sends=(), recvs=(), wait=True):
        """Batched point-to-point on this axis: sends/recvs are (tensor, index-in-axis) pairs. Waits
        for all, or (wait=False) returns the Works to .wait() on: a ring passes the next block while
        this one computes."""
        ops = [
            dist.P2POp(dist.isend, t, self.ranks[i], self.group)
            for t, i in sends
            if self._count("send", t)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self.ranks[i], self.group)
            for t, i in recvs
            if self._count("recv", t)
        ]
        works = dist.batch_isend_irecv(ops) if ops else []
        for work in works if wait else []:
            work.wait()
        return None if wait else works

    def all_to_all(self, out, t, out_splits=None, in_splits=None, wait=True):
        """all_to_all_single: rows in_splits[i] of t go to rank i of the axis, out gets rank i's
        rows for us in axis order (None: equal splits; gloo takes uneven ones). Counted as the bytes
        that leave this rank. wait=False: returns (out, a Work to .wait() on, or None)."""
        row = t[:1].numel() * t.element_size()
        mine = in_splits[self.rank] if in_splits is not None else t.shape[0] // max(self.size, 1)
        work = None
        if self.size > 1:
            self.log.record("all_to_all", self.name, self.size, t, (t.shape[0] - mine) * row)
            work = dist.all_to_all_single(
                out, t, out_splits, in_splits, group=self.group, async_op=not wait
            )
        else:
            out.copy_(t)
        return out if wait else (out, work)


def layout(dp=1, pp=1, tp=1, cp=1, ep=1, rank=None, dp_shard=None):
    """Every group of every axis as lists of ranks, {Grid attribute: [[ranks], ...]}: the one home
    of the layout (Grid builds these groups, meta.PaperGrid finds a rank's). Ranks as
    arange(world).view(dp, pp, cp, tp): tp fastest (neighbours inside a node), then cp (it trades
    keys and values every layer), pp, and dp outermost. dp_cp: the replicas of a dense weight (its
    gradient is reduced over dp and cp: cp ranks hold the same weights, other tokens). ep is carved
    out of dp (Megatron's way): dp index d = e_out x ep + e; ep: the ranks that trade tokens for one
    set of experts; edp: the replicas of one expert (same e, over e_out and cp). Hybrid sharding
    (dp_shard S < dp): dp index d = r x S + s; dp_shard: the S neighbouring dp ranks (x cp) that
    shard ZeRO's state (inside a host), dp_rep: the dp / S ranks with the same s (across hosts);
    S = dp (the default): dp_shard is dp_cp, dp_rep one rank each. rank: only the groups that hold
    it (meta.PaperGrid: one rank of any world without listing every group)."""
    world = dp * pp * cp * tp
    g = torch.arange(world).view(dp, pp, cp, tp)
    D, P, C, T = range(dp), range(pp), range(cp), range(tp)
    O, E = range(dp // ep), range(ep)  # ep's outer index and its index inside dp
    S = dp_shard or dp
    R, H = range(dp // S), range(S)  # hybrid: the replicate index and the index inside a shard
    if rank is not None:  # the rank's own coordinates only
        d, p, c, t = (int(i) for i in torch.unravel_index(torch.tensor(rank), g.shape))
        D, P, C, T, O, E = [d], [p], [c], [t], [d // ep], [d % ep]
        R, H = [d // S], [d % S]

    return {
        "tp": [g[d, p, c, :] for d in D for p in P for c in C],
        "cp": [g[d, p, :, t] for d in D for p in P for t in T],
        "pp": [g[d, :, c, t] for d in D for c in C for t in T],
        "dp": [g[:, p, c, t] for p in P for c in C for t in T],
        "dp_cp": [g[:, p, :, t].flatten() for p in P for t in T],
        "ep": [g[o * ep : (o + 1) * ep, p, c, t] for o in O for p in P for c in C for t in T],
        "edp": [g[e::ep, p, :, t].flatten() for e in E for p in P for t in T],
        # tied embedding: first and last stage sum its gradients (Megatron's embedding group)
        "embed": [g[d, [0, pp - 1], c, t].unique() for d in D for c in C for t in T],
        # hybrid sharding: the shard group (dp_shard x cp, inside a host) and the replicate group
        "dp_shard": [g[r * S : (r + 1) * S, p, :, t].flatten() for r in R for p in P for t in T],
        "dp_rep": [g[s::S, p, c, t] for s in H for p in P for c in C for t in T],
    }


# an axis's name in the CommLog's tables, where it differs
SHORT = {"dp_cp": "dpcp", "embed": "emb", "dp_shard": "dps", "dp_rep": "dpr"}


def check_layout(world, dp=1, pp=1, tp=1, cp=1, ep=1, dp_shard=None):
    """One line for a layout the world cannot hold."""
    if min(dp, pp, tp, cp, ep) < 1:
        raise ValueError(f"every axis must be >= 1: dp {dp}, pp {pp}, tp {tp}, cp {cp}, ep {ep}")
    if dp * pp * cp * tp != world:
        raise ValueError(
            f"world size {world} != dp {dp} x pp {pp} x cp {cp} x tp {tp}; "
            f"launch dp*pp*cp*tp processes or change the layout"
        )
    if dp % ep:
        raise ValueError(
            f"--ep {ep} must divide dp {dp}: expert parallelism is carved out of the data-parallel "
            f"ranks; pick --ep dividing {dp}"
        )
    if dp_shard and (dp_shard < 0 or dp % dp_shard):  # None or 0: all of dp
        raise ValueError(
            f"--dp-shard {dp_shard} must divide dp {dp}: hybrid sharding splits the dp ranks into "
            f"groups of --dp-shard (inside a host) replicated dp / dp-shard times; pick a divisor "
            f"of {dp}"
        )


class Grid:
    """The (dp, pp, cp, tp) rank grid, and ep inside dp; dp_shard: hybrid sharding's shard group
    size (None or 0: all of dp). Every rank builds every group, in one order (a torch rule), and never
    two for the same ranks: ep = dp (ep = dp size) is one group under two names."""

    def __init__(self, dp=1, pp=1, tp=1, cp=1, ep=1, dp_shard=None):
        world, rank = dist.get_world_size(), dist.get_rank()
        check_layout(world, dp, pp, tp, cp, ep, dp_shard)
        self.world, self.rank, self.log, self.timeout = world, rank, CommLog(), world_timeout()

        self.groups = {}  # ranks -> process group
        replicas = {}  # the groups of dp and dp_cp -> their Axis
        for attr, slices in layout(dp, pp, tp, cp, ep, dp_shard=dp_shard).items():
            key = tuple(tuple(s.tolist()) for s in slices)
            # a replica axis equal to one before it (dp_cp when cp = 1, edp when ep = 1, dp_shard
            # without hybrid sharding) is that one, by its name
            axis = replicas.get(key) if attr in ("dp_cp", "edp", "dp_shard", "dp_rep") else None
            setattr(self, attr, axis or self._axis(SHORT.get(attr, attr), slices))
            if attr in ("dp", "dp_cp"):
                replicas.setdefault(key, getattr(self, attr))

        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = (
            self.dp.rank,
            self.pp.rank,
            self.cp.rank,
            self.tp.rank,
        )
        self.first_stage, self.last_stage = self.pp_rank == 0, self.pp_rank == pp - 1

        # the whole world (health, checks)
        self.all = Axis("all", dist.group.WORLD, range(world), rank, self.log)
        self.backend = dist.get_backend()
        # the device init chose
        self.device = default_device("cuda" if self.backend == "nccl" else "cpu")
        self.host = socket.gethostname()
        store().set(f"nanomega/host/{rank}", self.host)  # for lifecycle.lost_ranks: who was where

    # every group made first, on every rank, in one order (new_group's rule)
    def _axis(self, name, slices):
        groups = [(ranks.tolist(), self._group(ranks.tolist())) for ranks in slices]
        return next(
            (
                Axis(name, g, ranks, self.rank, self.log)
                for ranks, g in groups
                if self.rank in ranks
            ),
            None,
        )

    # one rank: no group (its Axis calls no collective; NCCL: no communicator)
    def _group(self, ranks):
        if len(ranks) == 1 or len(ranks) == self.world:
            return None if len(ranks) == 1 else dist.group.WORLD
        if tuple(ranks) not in self.groups:  # the world's timeout, not new_group's 30 min (gloo)
            self.groups[tuple(ranks)] = dist.new_group(ranks, timeout=self.timeout)
        return self.groups[tuple(ranks)]

    def barrier(self):
        dist.barrier()

    def axis(self, name, ranks):
        """An Axis over any subset of the ranks (a health check's pair of hosts, say), counted in
        this grid's log. Collective (new_group's rule): every rank calls it with the same ranks; one
        outside gets None."""
        group = self._group(ranks := sorted(ranks))
        return Axis(name, group, ranks, self.rank, self.log) if self.rank in ranks else None

    def __repr__(self):
        cp = f"cp {self.cp_rank}/{self.cp.size}, " if self.cp.size > 1 else ""
        return (
            f"Grid(rank {self.rank}/{self.world} on {self.host}: dp {self.dp_rank}/{self.dp.size}, "
            f"pp {self.pp_rank}/{self.pp.size}, {cp}tp {self.tp_rank}/{self.tp.size}, {self.device})"
        )


def store():
    """The job's key-value store (torchrun's, on the rendezvous host): reachable when
    collectives are not."""
    return dist.distributed_c10d._get_default_store()


def world_timeout():
    """The default group's collective timeout (init's --collective-timeout); None where the
    backend hides it."""
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    try:
        return dist.group.WORLD._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def default_device(requested="auto") -> torch.device:
    """The one place that decides the device: cuda:LOCAL_RANK when CUDA is there (or
    asked for), else cpu."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        local, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local >= count:
            raise ValueError(
                f"LOCAL_RANK {local} but this node sees {count} CUDA device(s): launch at most "
                f"{count} processes per node (torchrun --nproc-per-node {count}) or check "
                f"CUDA_VISIBLE_DEVICES"
            )
        return torch.device("cuda", local)
    return torch.device("cpu")


def init(device="auto", timeout_s=None):
    """Start torch.distributed from torchrun's environment, or as a world of one,
    and pick the backend.

    Under torchrun the group is built on torchrun's own store (is_master=False) behind a prefix
    keyed by the restart count: after `--max-restarts` restarts a fresh store handshake is used each
    time (a plain env:// init was seen to hang in gloo's connectFullMesh after restarts).
    """
    dev = default_device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return dev
    timeout = datetime.timedelta(
        seconds=float(timeout_s or os.environ.get("NANOMEGA_TIMEOUT", 300))
    )
    env = os.environ
    if "WORLD_SIZE" not in env:  # a plain `python train.py`: a world of one
        store, rank, world = dist.HashStore(), 0, 1
    else:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            base = dist.TCPStore(
                env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout
            )
            store = dist.PrefixStore(f"nanomega/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)
        else:
            store = dist.TCPStore(
                env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, rank == 0, timeout=timeout
            )
    # device_id (CUDA): NCCL communicators are created now and bound to this rank's GPU, so a
    # collective (a barrier on WORLD) never has to guess the device
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=dev if dev.type == "cuda" else None,
    )
    return dev


def shutdown():
    """After a clean end on every rank: a barrier, then destroy_process_group (NCCL: frees the
    communicators). A gloo rank destroying its group while a peer on another host still used it made
    that peer abort at exit."""
    dist.barrier()
    dist.destroy_process_group()
