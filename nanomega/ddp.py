"""Data parallelism (PyTorch's DDP): every rank a replica, gradients averaged while backward runs.

Gradients are added into flat buckets (flat.py, bucket_mb each) as backward produces them; a
complete bucket is all-reduced at once, while backward computes earlier layers, in the same bucket
order on every rank. Micro-batches before the last run under no_sync(). Replicas start equal
(start_equal: parameters and buffers verified by checksum, or broadcast from dp rank 0, as DDP).
    bytes one rank sends per step   2 (N-1)/N Psi   (ring all-reduce, dist.py; Psi = gradient bytes)
    memory per parameter            the weight + a grad_dtype gradient (+ the optimizer's state)
Lesson: lessons/04-data-parallel-and-zero.md
"""

import contextlib
import dataclasses
import functools
import weakref
from collections import deque

import torch

from .flat import FlatGroup, split_by_size


def start_equal(model, axis, init="verify", keep=lambda name: True):
    """Every rank of `axis` starts from dp rank 0's parameters and buffers: "verify" compares 2 fp64
    sums per tensor (one all-gather, one clear error), "broadcast" copies them from rank 0. A model
    with parameters still on the meta device has nothing to compare: they are drawn from one seed
    later (meta.py), alike. keep(name): the parameters `axis` replicates (experts: only over
    grid.edp)."""
    if init not in ("verify", "broadcast"):
        raise ValueError(f"init={init!r}: use 'verify' or 'broadcast'")
    tensors = [p for k, p in model.named_parameters() if keep(k)] + [
        b for _, b in model.named_buffers()
    ]

    if axis.size == 1 or any(p.is_meta for p in model.parameters()):
        return

    if init == "broadcast":
        with torch.no_grad():
            for t in tensors:
                axis.broadcast(t.data)
        return

    # verify: every rank's 2 sums per tensor, gathered, against dp rank 0's
    sums = torch.stack(
        [
            torch.stack([t.detach().double().sum(), t.detach().double().square().sum()])
            for t in tensors
        ]
    ).reshape(-1)  # 2 fp64 numbers per tensor
    every = axis.all_gather(sums.new_empty(axis.size * sums.numel()), sums).view(axis.size, -1)
    differ = [r for r in range(axis.size) if not torch.equal(every[r], every[0])]
    if differ:
        raise ValueError(
            f"data-parallel ranks {differ} start from other weights than dp rank 0 (seed the "
            f"model alike on every rank, or pass init='broadcast')"
        )


def bucket_groups(named_params, bucket_mb, axis, split=False, alone=(), values=None, device=None):
    """Flat groups of about bucket_mb each, in the order backward fills them (the last layers
    first); split: each is split over the ranks of `axis` (ZeRO-1/2). alone: parameters with a
    bucket each. values, device: meta parameters drawn into the buckets (flat.FlatGroup)."""
    buckets = split_by_size(named_params[::-1], bucket_mb * 2**20, alone)
    n, rank = (axis.size, axis.rank) if split else (1, 0)
    return [FlatGroup(b[::-1], n, rank, split=split, values=values, device=device) for b in buckets]


@dataclasses.dataclass(eq=False)
class Progress:
    """One group's reduction; GradBuckets is its one writer."""

    # this backward: indices whose gradient is in
    arrived: set = dataclasses.field(default_factory=set)
    launched: bool = False  # this backward: the reduction has started
    reduced: bool = False  # reduced at least once since the last step
    # keep="shard": this backward's full gradient, until reduce-scattered
    bucket: torch.Tensor | None = None


def call_if_alive(method, *args):
    """method(*args) for a weakref.WeakMethod whose object still lives; nothing once it is gone."""
    bound = method()
    if bound is not None:
        bound(*args)


class GradBuckets:
    """The gradients of `groups` (flat.py, none split), all-reduced and averaged over `axis` while
    backward runs, each group once it and every group before it is complete (one order on every
    rank).

    Under no_sync() nothing is sent: gradients accumulate in the buffers, a synced backward reduces.
    to_params  True: the caller's own optimizer reads p.grad, the mean after every synced backward;
               False: the engine reads the buffers, and p.grad may stay a view of them
               (gradient_as_bucket_view).
    ZeRO's reduce-scatter variants extend this class (zero_buckets.py).
    """

    def __init__(self, groups, axis, grad_dtype=torch.float32, to_params=False):
        self.groups, self.axis, self.grad_dtype = groups, axis, grad_dtype
        self.to_params = to_params
        self.progress = [Progress() for _ in groups]
        # _backward: the autograd graph task whose end is queued (None: none in progress)
        self._no_sync, self._backward, self._pending = False, None, deque()
        # local() true: no reduction at all, the gradients stay this rank's (an optimizer that
        # averages over dp itself after a warm-up: onebit.py, through zero_rules.communicates)
        self.local = lambda: False
        # the hooks hold self weakly: Python's gc does not see a parameter's post-accumulate-grad
        # hooks, so parameter -> hook -> self -> groups -> parameter would never be freed (nor the
        # gradient buffers)
        on_grad = weakref.WeakMethod(self._on_grad)
        for j, g in enumerate(groups):
            self._allocate_grad(g)
            for i, p in enumerate(g.params):
                p.register_post_accumulate_grad_hook(
                    functools.partial(call_if_alive, on_grad, j, i)
                )

    def _allocate_grad(self, g):
        g.grad = torch.zeros(g.padded, dtype=self.grad_dtype, device=g.device)

    def _syncing(self):
        return not self._no_sync and not self.local()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward without communication: gradients accumulate locally until a synced backward."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def _buffer(self, g, state):
        """Where a gradient of group g is added, and whether p.grad may stay a view of it."""
        return g.grad, True

    def _on_grad(self, j, i, p):
        if p.grad is None:  # a weight gradient deferred to a zero-bubble W (wgrad.py): none yet
            return
        g, state = self.groups[j], self.progress[j]
        task = torch._C._current_graph_task_id()
        if task != self._backward:  # once per backward: finish what is left when autograd is done
            self._settle()  # (a backward that raised never reached its end: its work waited here)
            self._backward = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

        buf, as_view = self._buffer(g, state)
        # autograd's own new tensor: accumulate it into the buffer, in grad_dtype
        if p.grad._base is not buf:
            slot = buf[g.offsets[i] : g.offsets[i] + g.sizes[i]].view_as(p.grad)
            slot.add_(p.grad)
            # The buffer is zeroed after each step, so the slot can stay p.grad: autograd then adds
            # later gradients straight into the buffer (PyTorch DDP's gradient_as_bucket_view), one
            # pass over the gradient fewer. Not for bf16 weights with fp32 sums, nor ZeRO-2/3's
            # per-step buckets, nor when p.grad is the caller's (to_params); there the new tensor is
            # dropped.
            keep = as_view and not self.to_params and p.dtype == self.grad_dtype
            p.grad = slot if keep else None

        if self._syncing():
            state.arrived.add(i)
            self._launch_ready(j)

    def _launch_ready(self, j):
        """Launch, in group order, every group whose gradients are all in."""
        for k, g in enumerate(self.groups):
            if not self.progress[k].launched:
                if len(self.progress[k].arrived) < len(g.params):
                    return
                self._reduce(k)

    def _launched(self, j):
        """Mark group j's reduction as started; -> the group."""
        state = self.progress[j]
        state.launched = state.reduced = True
        return self.groups[j]

    def _reduce(self, j):
        """The sum, then the mean, on every rank (a later synced backward adds to it); a world of
        one holds the mean already (x / 1: a pass for nothing)."""
        g, n = self._launched(j), self.axis.size
        if n > 1:
            self._start(self.axis.start("all_reduce", g.grad), lambda: g.grad.div_(n))

    def _start(self, work, finish):
        self._pending.append((work, finish))

    def _finish_one(self):
        work, finish = self._pending.popleft()
        if work is not None:
            work.wait()
        finish()

    def _settle(self):
        """Wait for every reduction still in flight and start the bookkeeping afresh. Autograd drops
        the end-of-backward callback of a backward that raised: its all-reduces stayed in flight,
        past the step and (a harness ending there) past the process group, and the next backward
        never finished. Here the next backward, zero_grad or finish waits for them; the failed
        step's partial sums stay in the buffers until zero_grad."""
        while self._pending:
            work, _ = self._pending.popleft()
            if work is not None:
                work.wait()
        self._backward = None
        for state in self.progress:
            state.arrived.clear()
            state.launched, state.bucket = False, None

    def _end_backward(self):
        """Autograd's last callback: reduce what unused parameters held back (in index order), wait
        for every reduction (the next backward adds into the same buffers), reset; to_params: hand
        p.grad the means."""
        self._backward = None
        synced = self._syncing()
        if synced:
            for j, state in enumerate(self.progress):
                if not state.launched:
                    self._reduce(j)

        # wait for every reduction (the next backward adds into the same buffers), reset
        while self._pending:
            self._finish_one()
        for state in self.progress:
            state.arrived.clear()
            state.launched = False

        if self.to_params and synced:
            for g, state in zip(self.groups, self.progress):
                if not g.split:
                    for p, v in zip(g.params, g.views(g.grad)):
                        p.grad = v.to(p.dtype, copy=True)
                    g.grad.zero_()
                    state.reduced = False

    def finish(self):
        """Reduce the groups no synced backward reduced (every micro-batch ran under no_sync), wait
        for all."""
        for j, state in enumerate(self.progress):
            if not state.reduced and not self.local():
                self._reduce(j)
        while self._pending:
            self._finish_one()

    def zero_grad(self):
        """Start the next step's accumulation at zero (what a failed backward left in flight
        waited for first)."""
        self._settle()
        for g, state in zip(self.groups, self.progress):
            state.reduced = False
            if g.grad is not None:
                g.grad.zero_()


class DistributedDataParallel:
    """Gradient buckets of `model` averaged over grid.dp while backward runs, for the caller's own
    optimizer.

    init: "verify" (default) checks that every dp rank starts from the same parameters and buffers;
    "broadcast" copies dp rank 0's. Use: forward/backward (`with ddp.no_sync():` on all but the last
    micro-batch); p.grad then holds the mean gradient; optimizer.step(); ddp.zero_grad() (or
    model.zero_grad()).
    """

    def __init__(self, model, grid, bucket_mb=25, grad_dtype=torch.float32, init="verify"):
        trainable = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(
                "the model has no trainable parameters (all requires_grad=False): nothing to synchronise"
            )
        self.module, self.grid, self.axis = model, grid, grid.dp
        start_equal(model, self.axis, init)
        self.buckets = GradBuckets(
            bucket_groups(trainable, bucket_mb, self.axis), self.axis, grad_dtype, to_params=True
        )
        self.groups = self.buckets.groups

    def no_sync(self):
        return self.buckets.no_sync()

    def zero_grad(self):
        """p.grad = None and the buffers at zero: what was accumulated is dropped."""
        self.buckets.zero_grad()
        for g in self.groups:
            for p in g.params:
                p.grad = None
