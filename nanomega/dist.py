"""The rank grid and the one layer every collective goes through.

Idea: `world = dp * pp * tp` ranks laid out as `arange(world).view(dp, pp, tp)`: tensor parallel ranks are
neighbours (inside a node, fastest links), pipeline stages next, data parallel outermost. Each axis gets its
own process group, wrapped in an `Axis` whose collectives record (op, axis, dtype, bytes) in a `CommLog`, so
lessons and tests can hold measured traffic against formulas. Device and backend are chosen here and
nowhere else: nccl on CUDA, gloo on CPU.

Bytes one rank sends for a collective over n ranks on a ring, for a tensor of B bytes:
    all_reduce 2(n-1)/n * B      reduce_scatter (n-1)/n * B_in      all_gather (n-1)/n * B_out
Lessons: lessons/02-data-parallel-and-zero.md (the formulas), lessons/09-3d-parallelism.md (the grid).
"""
import datetime
import os
import pickle
import socket
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# One-tensor collectives: newer torch (2.13 here) names them all_gather_single / reduce_scatter_single
# (pytorch#186123; the old names stay as deprecated wrappers); torch 2.11 and older have only
# all_gather_into_tensor / reduce_scatter_tensor. Resolved once here, the newer name first.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0 if n > 1 else 0.0,
        "send": lambda n: 1.0, "recv": lambda n: 0.0}


@dataclass
class CommLog:
    """Per-rank traffic: (op, axis, dtype) -> [calls, tensor bytes]. `wire_bytes` applies the ring factors."""
    counts: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    sizes: dict = field(default_factory=dict)  # axis name -> ranks in it

    def record(self, op, axis, n, tensor):
        self.sizes[axis] = n
        entry = self.counts[(op, axis, str(tensor.dtype).replace("torch.", ""))]
        entry[0] += 1
        entry[1] += tensor.numel() * tensor.element_size()

    def bytes(self, op=None, axis=None) -> int:
        return sum(b for (o, a, _), (_, b) in self.counts.items() if op in (None, o) and axis in (None, a))

    def wire_bytes(self, axis=None) -> float:
        return sum(RING[o](self.sizes[a]) * b for (o, a, _), (_, b) in self.counts.items() if axis in (None, a))

    def reset(self):
        self.counts.clear()

    def table(self) -> str:
        rows = [f"{op:>14} {axis:>3} {dt:>8} x{c:<5} {b / 2**20:10.3f} MiB"
                for (op, axis, dt), (c, b) in sorted(self.counts.items())]
        return "\n".join(rows)


class Axis:
    """One axis of the grid: its process group (None on one rank), this rank's place in it, counted collectives."""

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
        """all_reduce(out), all_gather(out, t) or reduce_scatter(out, t) launched without waiting, counted as
        the blocking ones: returns a Work to .wait() on, or None on a one-rank axis (out is already done).
        ZeRO overlaps its gradient reduction with backward, and its parameter prefetch with compute, this way."""
        if not self._count(op, t if op == "reduce_scatter" else out):
            if t is not None:
                out.copy_(t)
            return None
        if op == "all_reduce":
            return dist.all_reduce(out, group=self.group, async_op=True)
        collective = ALL_GATHER_SINGLE if op == "all_gather" else REDUCE_SCATTER_SINGLE
        return collective(out, t, group=self.group, async_op=True)

    def broadcast(self, t, src_index=0):
        if self._count("broadcast", t):
            dist.broadcast(t, src=self.ranks[src_index], group=self.group)
        return t

    def barrier(self):
        if self.size > 1:
            dist.barrier(group=self.group)

    def all_gather_object(self, obj):
        """[every rank's obj] in axis order (pickled; for metadata), counted as an all-gather of the largest pickle."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        self.log.record("all_gather", self.name, self.size,
                        torch.empty(self.size * max(len(pickle.dumps(o)) for o in out), dtype=torch.uint8))
        return out

    def p2p(self, sends=(), recvs=()):
        """Batched point-to-point on this axis: sends/recvs are (tensor, index-in-axis) pairs; waits for all."""
        ops = [dist.P2POp(dist.isend, t, self.ranks[i], self.group) for t, i in sends if self._count("send", t)]
        ops += [dist.P2POp(dist.irecv, t, self.ranks[i], self.group) for t, i in recvs if self._count("recv", t)]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()


class Grid:
    """The (dp, pp, tp) rank grid. Every rank builds every group, in the same order (a torch rule)."""

    def __init__(self, dp=1, pp=1, tp=1):
        world, rank = dist.get_world_size(), dist.get_rank()
        for flag, v in (("--dp", dp), ("--pp", pp), ("--tp", tp)):
            if v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        if dp * pp * tp != world:
            raise ValueError(f"world size {world} != dp {dp} x pp {pp} x tp {tp}; "
                             f"launch dp*pp*tp processes or change the layout")
        self.world, self.rank, self.log, self.timeout = world, rank, CommLog(), world_timeout()
        grid = torch.arange(world).view(dp, pp, tp)
        self.dp_rank, self.pp_rank, self.tp_rank = [int(c) for c in (grid == rank).nonzero()[0]]
        # slices along each axis: tp varies fastest, so (d, p, :) is one tp group
        self.tp = self._axis("tp", [grid[d, p, :] for d in range(dp) for p in range(pp)])
        self.pp = self._axis("pp", [grid[d, :, t] for d in range(dp) for t in range(tp)])
        self.dp = self._axis("dp", [grid[:, p, t] for p in range(pp) for t in range(tp)])
        self.all = Axis("all", dist.group.WORLD, range(world), rank, self.log)  # the whole world (health, checks)
        # tied embedding: first and last pipeline stage sum the embedding gradients (Megatron's embedding group)
        self.embed = self._axis("emb", [grid[d, [0, pp - 1], t].unique() for d in range(dp) for t in range(tp)])
        self.backend = dist.get_backend()
        self.device = default_device("cuda" if self.backend == "nccl" else "cpu")  # the device init chose
        self.host = socket.gethostname()
        store().set(f"nanomega/host/{rank}", self.host)  # for lost_ranks: who was where
        # torchrun numbers ranks host by host (RANK = node rank x LOCAL_WORLD_SIZE + LOCAL_RANK), so the
        # contiguous tp groups above stay inside a host exactly when LOCAL_WORLD_SIZE % tp == 0
        spanning = split_groups([grid[d, p, :].tolist() for d in range(dp) for p in range(pp)],
                                int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if spanning and rank == 0:
            print(f"warning: tensor-parallel group {spanning[0]} spans hosts (--tp {tp} with "
                  f"{os.environ.get('LOCAL_WORLD_SIZE')} ranks per host): its per-layer all-reduces cross the "
                  f"network; use --tp dividing the ranks per host", flush=True)

    def _axis(self, name, slices):  # every group made first, on every rank, in one order (new_group's rule)
        groups = [(ranks.tolist(), self._group(ranks.tolist())) for ranks in slices]
        return next((Axis(name, g, ranks, self.rank, self.log) for ranks, g in groups if self.rank in ranks), None)

    def _group(self, ranks):  # one rank: no group (its Axis calls no collective; NCCL: no communicator)
        return None if len(ranks) == 1 else dist.group.WORLD if len(ranks) == self.world else \
            dist.new_group(ranks, timeout=self.timeout)  # the world's timeout, not new_group's 30 min (gloo)

    def barrier(self):
        dist.barrier()

    def axis(self, name, ranks):
        """An Axis over any subset of the ranks (a health check's pair of hosts, say), counted in this grid's
        log. Collective (new_group's rule): every rank calls it with the same ranks; one outside gets None."""
        group = self._group(ranks := sorted(ranks))
        return Axis(name, group, ranks, self.rank, self.log) if self.rank in ranks else None

    @property
    def first_stage(self):
        return self.pp_rank == 0

    @property
    def last_stage(self):
        return self.pp_rank == self.pp.size - 1

    def __repr__(self):
        return (f"Grid(rank {self.rank}/{self.world} on {self.host}: dp {self.dp_rank}/{self.dp.size}, "
                f"pp {self.pp_rank}/{self.pp.size}, tp {self.tp_rank}/{self.tp.size}, {self.device})")


def store():
    """The job's key-value store (torchrun's, on the rendezvous host): reachable when collectives are not."""
    return dist.distributed_c10d._get_default_store()


def world_timeout():
    """The default group's collective timeout (init's --collective-timeout); None where the backend hides it."""
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    try:
        return dist.group.WORLD._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


COMM_ERRORS = ("gloo", "NCCL", "Timed out", "Connection", "timeout")


def lost_ranks(error, wait_s=5.0):
    """After a collective failed: which ranks still answer through the store within wait_s seconds?

    Returns None when `error` is not a communication error or nobody is missing (re-raise it), "" on every
    rank but 0, and on rank 0 one line naming the ranks (and their hosts) that did not answer. A rank whose
    host is cut off cannot reach the store either; it gives up after wait_s and stays silent: rank 0 names it.
    """
    if not dist.is_initialized() or not any(k in str(error) for k in COMM_ERRORS):
        return None
    rank, world, kv = dist.get_rank(), dist.get_world_size(), store()
    kv.set_timeout(datetime.timedelta(seconds=wait_s))
    try:
        kv.set(f"nanomega/alive/{rank}", "1")
    except Exception:  # cut off from the store as well: nothing more to learn here
        return ""
    if rank != 0:  # stay until rank 0 has spoken: its host's agent stops all its workers when one exits
        try:
            kv.wait(["nanomega/verdict"], datetime.timedelta(seconds=3 * wait_s))
        except Exception:
            pass
        return ""
    deadline = time.monotonic() + wait_s
    missing = list(range(world))
    while missing and time.monotonic() < deadline:  # bounded: wait_s seconds, polled every 0.1 s
        missing = [r for r in missing if not kv.check([f"nanomega/alive/{r}"])]
        time.sleep(0.1)
    kv.set("nanomega/verdict", str(missing))
    if not missing:  # every rank answers: not a lost host; the traceback says more than a line
        return None
    first = str(error).strip().splitlines()[0][:160]
    hosts = sorted({kv.get(f"nanomega/host/{r}").decode() for r in missing if kv.check([f"nanomega/host/{r}"])})
    return (f"rank(s) {', '.join(map(str, missing))} on {', '.join(hosts) or 'unknown hosts'} unreachable: a "
            f"collective failed ({first}) and they did not answer through the store within {wait_s:.0f} s; "
            f"the job stops here and resumes from its last checkpoint when restarted (torchrun --max-restarts)")


def split_groups(groups, per_host):
    """The groups (lists of ranks) whose ranks sit on more than one host, with ranks numbered host by host."""
    return [g for g in groups if len({r // per_host for r in g}) > 1]


def default_device(requested="auto") -> torch.device:
    """The one place that decides the device: cuda:LOCAL_RANK when CUDA is there (or asked for), else cpu."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        local, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        if local >= count:
            raise ValueError(f"LOCAL_RANK {local} but this node sees {count} CUDA device(s): launch at most "
                             f"{count} processes per node (torchrun --nproc-per-node {count}) or check "
                             f"CUDA_VISIBLE_DEVICES")
        return torch.device("cuda", local)
    return torch.device("cpu")


def init(device="auto", timeout_s=None):
    """Start torch.distributed from torchrun's environment, or as a world of one, and pick the backend.

    Under torchrun the group is built on torchrun's own store (is_master=False) behind a prefix keyed by
    the restart count: after `--max-restarts` restarts a fresh store handshake is used each time (a plain
    env:// init was seen to hang in gloo's connectFullMesh after restarts).
    """
    dev = default_device(device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return dev
    timeout = datetime.timedelta(seconds=float(timeout_s or os.environ.get("NANOMEGA_TIMEOUT", 300)))
    env = os.environ
    if "WORLD_SIZE" not in env:  # a plain `python train.py`: a world of one
        store, rank, world = dist.HashStore(), 0, 1
    else:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
            store = dist.PrefixStore(f"nanomega/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)
        else:
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, rank == 0, timeout=timeout)
    # device_id (CUDA): NCCL communicators are created now and bound to this rank's GPU, so a collective
    # (a barrier on WORLD) never has to guess the device
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=dev if dev.type == "cuda" else None)
    return dev


def shutdown():
    """After a clean end on every rank: a barrier, then destroy_process_group (NCCL: frees the communicators). A
    gloo rank destroying its group while a peer on another host still used it made that peer abort at exit."""
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue, threads):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)  # ranks share the cores: oversubscription makes everything crawl
    try:
        init(device="cpu", timeout_s=120)
        queue.put((rank, "ok", fn(*args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, world, *args, timeout=300, threads=1):
    """Run fn(*args) on `world` spawned CPU ranks (tests, lessons, bench); return the ranks' results. spawn, not
    fork (fork hangs with OpenMP); a free port per world; the first error or the timeout kills all."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, threads), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < world:
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
