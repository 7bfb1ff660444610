"""Data parallelism (PyTorch's DDP, Megatron's DistributedDataParallel): every rank a replica, gradients
averaged in flat buckets while backward runs.

Idea: N ranks each run the whole model on 1/N of the batch; before the optimizer step every rank must hold
the mean gradient. Not one all-reduce per parameter (latency-bound), nor one at the end (no overlap):
gradients are added into flat buckets (flat.py, bucket_mb each) as backward produces them, and a bucket is
all-reduced as soon as it is complete -- while backward goes on computing earlier layers' gradients -- in the
same bucket order on every rank (collectives must match across ranks). Micro-batches before the last run
under no_sync(): gradients accumulate locally and one reduction serves the whole step.
    bytes one rank sends per step   2 (N-1)/N Psi    (ring all-reduce, dist.py; Psi = gradient bytes)
    memory per parameter            the weight + a grad_dtype gradient (+ the optimizer's state)
Replicas must start equal -- ranks seeded differently would silently train different models -- so the
initial weights are verified by checksum (one clear error) or broadcast from dp rank 0, as DDP does.
Used alone, after every synced backward p.grad holds the averaged gradient, for the caller's own clipping and
optimizer. zero.ZeroEngine builds on this class: the same buckets, sharded over the ranks (its STAGE table
says which entries of the Plan each ZeRO stage changes), and it owns the optimizer.
Lesson: lessons/02-data-parallel-and-zero.md
"""
import contextlib
import dataclasses
import functools
from collections import deque

import torch

from .flat import FlatGroup, split_by_size

MAX_IN_FLIGHT = 2  # ZeRO-2/3: reductions launched but unfinished, each holding a full-gradient bucket alive


@dataclasses.dataclass(frozen=True)
class Plan:
    """How gradients are kept and reduced: DP below; zero.STAGE holds one per ZeRO stage."""
    sharded: bool  # the flat buffers are split over the dp ranks (False: every rank holds all of them)
    grad: str  # "full" or "shard": the gradient buffer a rank keeps between micro-batches
    reduce: str  # "all_reduce" or "reduce_scatter"
    write_back: str  # "none" or "all_gather": how every rank gets the updated parameters


DP = Plan(sharded=False, grad="full", reduce="all_reduce", write_back="none")


class DistributedDataParallel:
    """Gradient buckets of `model` reduced over grid.dp while backward runs.

    shared: this pipeline stage's copy of the tied embedding (pp.tied_embedding): a bucket of its own.
    init: "verify" (default) checks that every dp rank starts from the same weights; "broadcast" copies dp
    rank 0's. ZeroEngine passes its plan, its ZeRO-3 units (a callable building them once the initial weights
    are checked) and the trainable (name, parameter) pairs kept in flat buckets (`whole`, default all).
    Use: forward/backward (`with ddp.no_sync():` on all but the last micro-batch); p.grad is then averaged.
    """

    def __init__(self, model, grid, bucket_mb=25, grad_dtype=torch.float32, shared=None, init="verify", plan=DP,
                 units=None, whole=None):
        named = list(model.named_parameters())  # tied parameters once, under their first name
        trainable = [(k, p) for k, p in named if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters (all requires_grad=False): nothing to synchronise")
        self.module, self.grid, self.axis, self.plan = model, grid, grid.dp, plan
        self.grad_dtype, self.shared = grad_dtype, shared
        self.optimizer = None  # ZeroEngine: the optimizer of this rank's pieces; None: hand p.grad back
        self._no_sync, self._queued, self._pending = False, False, deque()
        self._initial_weights(named, init)
        self.sharded = units(self) if units else None  # ZeRO-3 (zero3.ShardedParameters)
        n, rank = (grid.dp.size, grid.dp_rank) if plan.sharded and not units else (1, 0)
        whole = trainable if whole is None else whole
        alone = [shared] if shared is not None else []
        buckets = split_by_size(whole[::-1], bucket_mb * 2**20, alone) if whole else []
        self.groups = [g for g in self.sharded.groups if g.trainable] if self.sharded else []
        for b in buckets:  # in the order backward fills them; beside ZeRO-3 units: replicated parameters
            g = FlatGroup(b[::-1], n, rank, replicated=units is not None)
            g.full = g.flatten(g.params)  # the parameters become views of one padded buffer
            g.bind(g.full)
            g.own = g.full[g.lo:g.hi]
            self.groups.append(g)
        for g in self.groups:
            self._allocate_grad(g)
            for i, p in enumerate(g.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, g, i))

    def _initial_weights(self, named, init):
        if init not in ("verify", "broadcast"):
            raise ValueError(f"init={init!r}: use 'verify' or 'broadcast'")
        if self.axis.size == 1:
            return
        if init == "broadcast":
            with torch.no_grad():
                for _, p in named:
                    self.axis.broadcast(p.data)
            return
        sums = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                            for _, p in named]).reshape(-1)  # 2 fp64 numbers per parameter
        every = self.axis.all_gather(sums.new_empty(self.axis.size * sums.numel()), sums).view(self.axis.size, -1)
        differ = [r for r in range(self.axis.size) if not torch.equal(every[r], every[0])]
        if differ:
            raise ValueError(f"data-parallel ranks {differ} start from other weights than dp rank 0 (seed the "
                             f"model alike on every rank, or pass init='broadcast')")

    def _allocate_grad(self, g):
        keep_full = self.plan.grad == "full" or g.replicated
        g.grad = torch.zeros(g.padded if keep_full else g.shard_numel, dtype=self.grad_dtype, device=g.device)
        g.grad_own = g.grad[g.lo:g.hi] if keep_full else g.grad  # the reduced gradient of the owned slice

    def _syncing(self):
        return self.plan.grad == "shard" or not self._no_sync

    @contextlib.contextmanager
    def no_sync(self):
        """Backward without communication, gradients accumulate locally: DP and ZeRO-1. ZeRO-2 and 3 keep only
        a 1/N slice of the gradient, so they reduce-scatter every micro-batch anyway (into that slice)."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def _queue_end_backward(self):
        if not self._queued:  # once per backward: finish what is left when autograd is done
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, g, i, p):
        self._queue_end_backward()
        sliced = self.plan.grad == "shard" and not g.replicated
        if sliced and g.bucket is None:
            g.bucket = torch.zeros(g.padded, dtype=self.grad_dtype, device=g.device)
        if g.grad is None:  # ZeRO-3 frees its gradient shard between steps
            self._allocate_grad(g)
        buf = g.bucket if sliced else g.grad
        if p.grad._base is not buf:  # autograd's own new tensor: accumulate it into the buffer, in grad_dtype
            slot = buf[g.offsets[i]:g.offsets[i] + g.sizes[i]].view_as(p.grad)
            slot.add_(p.grad)
            # The engine zeroes the buffer after each step, so the slot can stay p.grad: autograd then adds
            # later gradients straight into the buffer (PyTorch DDP's gradient_as_bucket_view), one pass over
            # the gradient fewer. Not for bf16 weights with fp32 sums, nor ZeRO-2/3's per-step buckets, nor
            # without an optimizer (p.grad is then the caller's); there the new tensor is dropped.
            keep = self.optimizer is not None and not sliced and p.dtype == self.grad_dtype
            p.grad = slot if keep else None
        if self._syncing():
            g.arrived.add(i)
            self._launch_ready(g)

    def _launch_ready(self, g):
        """ZeRO-3 reduces a unit as soon as it is complete; otherwise buckets launch in their index order,
        the same on every rank (collectives must match across ranks)."""
        if self.sharded is not None:
            if len(g.arrived) == len(g.params) and not g.launched:
                self._reduce(g)
            return
        for h in self.groups:
            if not h.launched:
                if len(h.arrived) < len(h.params):
                    return
                self._reduce(h)

    def _reduce(self, g):
        g.launched = g.reduced = True
        n = self.axis.size
        if g.grad is None:
            self._allocate_grad(g)
        if not self.plan.sharded or g.replicated:  # the sum, then the mean, on every rank (a later synced
            if n > 1:  # backward adds to it); a world of one holds the mean already (x / 1: a pass for nothing)
                self._start(self.axis.start("all_reduce", g.grad), lambda: g.grad.div_(n))
            return
        out = torch.empty(g.shard_numel, dtype=self.grad_dtype, device=g.device)
        if self.plan.grad == "full":  # ZeRO-1: owned slice := the sum over ranks; the rest (others') := 0
            self._start(self.axis.start("reduce_scatter", out, g.grad),
                        lambda: (g.grad.zero_(), g.grad_own.copy_(out)))
            return
        bucket = g.bucket if g.bucket is not None else torch.zeros(g.padded, dtype=self.grad_dtype, device=g.device)
        g.bucket = None  # alive only until its reduce-scatter finishes (the closure holds it)
        self._start(self.axis.start("reduce_scatter", out, bucket), lambda: (g.grad.add_(out), bucket))
        if self.sharded is not None:  # ZeRO-3: backward is done with this unit's parameters
            self.sharded.release(g)

    def _start(self, work, finish):
        self._pending.append((work, finish))
        while self.plan.grad == "shard" and len(self._pending) > MAX_IN_FLIGHT:  # else: no transient buffers
            self._finish_one()

    def _finish_one(self):
        work, finish = self._pending.popleft()
        if work is not None:
            work.wait()
        finish()

    def _end_backward(self):
        """Autograd's last callback: reduce what unused parameters held back (in index order), wait for every
        reduction (the next backward adds into the same buffers), reset. Without an optimizer: hand the
        averaged gradients to p.grad; the buffers start the next accumulation at zero."""
        self._queued = False
        synced = self._syncing()
        if synced:
            for g in self.groups:
                if not g.launched:
                    self._reduce(g)
        while self._pending:
            self._finish_one()
        for g in self.groups:
            g.arrived.clear()
            g.launched = False
        if self.sharded is not None:
            self.sharded.end_backward()
        if self.optimizer is None and synced:
            for g in self.groups:
                for p, v in zip(g.params, g.views(g.grad)):
                    p.grad = v.to(p.dtype, copy=True)
                g.grad.zero_()
                g.reduced = False
