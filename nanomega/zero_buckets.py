"""ZeRO's gradient buckets: data parallelism's buckets (ddp.py), reduce-scattered instead.

A split group (flat.py) is reduce-scattered: rank r's slice of the buffer receives the sum over the
ranks (its owner divides, and steps only its slice). Groups not split are all-reduced as in ddp.py.
    ScatterBuckets  ZeRO-1: the full gradient accumulates (no_sync() sends nothing); one
                    reduce-scatter per step: the slice holds the sum, the rest zeros
    ShardBuckets    ZeRO-2/3: only the slice is kept, so every micro-batch is reduce-scattered
                    into it (a transient full bucket per group, at most MAX_IN_FLIGHT alive)
    gradient bytes per parameter   ScatterBuckets: grad_dtype's; ShardBuckets: 1/N of them
Lesson: lessons/04-data-parallel-and-zero.md
"""

import contextlib

import torch

from .ddp import GradBuckets

MAX_IN_FLIGHT = (
    2  # ZeRO-2/3: reductions launched but unfinished, each holding a full-gradient bucket alive
)


class ScatterBuckets(GradBuckets):
    """ZeRO-1: split groups reduce-scattered at the step's synced backward; the owned slice := the
    sum over ranks, the rest (other ranks' slices) := 0. Groups not split: ddp.GradBuckets'."""

    def _reduce(self, j):
        if not self.groups[j].split:
            return super()._reduce(j)
        g = self._launched(j)
        out = torch.empty(g.shard_numel, dtype=self.grad_dtype, device=g.device)
        self._start(
            self.axis.start("reduce_scatter", out, g.grad),
            lambda: (g.grad.zero_(), g.grad_own.copy_(out)),
        )


class ShardBuckets(GradBuckets):
    """ZeRO-2/3: a split group keeps only its owned slice of the gradient; each micro-batch's
    gradients go into a transient full bucket, reduce-scattered into the slice (added to it: the
    micro-batches accumulate there).

    in_order      True: launch in the group order (the same on every rank); False: each group when
                  complete (ZeRO-3's units, completed in the same order on every rank).
    after_reduce  after_reduce(group): called once a split group's reduction has started
                  (ZeRO-3 frees the unit).
    to_params     the caller's optimizer reads the slices: averaged in place (x / 2^k is exact).
    scatter       scatter(out, bucket) -> Work or None: another reduce-scatter (zeropp.py's qgZ);
                  None: the axis's.
    """

    def __init__(
        self,
        groups,
        axis,
        grad_dtype=torch.float32,
        in_order=True,
        after_reduce=None,
        to_params=False,
        scatter=None,
    ):
        self.in_order, self.after_reduce, self.scatter = in_order, after_reduce, scatter
        super().__init__(groups, axis, grad_dtype, to_params)

    def _allocate_grad(self, g):
        g.grad = torch.zeros(
            g.shard_numel if g.split else g.padded, dtype=self.grad_dtype, device=g.device
        )

    def _syncing(self):
        # a 1/N slice cannot hold a micro-batch's full gradient: no_sync() changes nothing
        return True

    def _buffer(self, g, state):
        if not g.split:
            return super()._buffer(g, state)
        if state.bucket is None:
            state.bucket = torch.zeros(g.padded, dtype=self.grad_dtype, device=g.device)
        if g.grad is None:  # ZeRO-3 frees its gradient shard between steps
            self._allocate_grad(g)
        return state.bucket, False  # the bucket is gone after its reduce-scatter: p.grad is dropped

    def _launched(self, j):
        g = super()._launched(j)
        if g.grad is None:  # ZeRO-3 frees its gradient shard between steps
            self._allocate_grad(g)
        return g

    def _launch_ready(self, j):
        if self.in_order:
            return super()._launch_ready(j)
        if (
            len(self.progress[j].arrived) == len(self.groups[j].params)
            and not self.progress[j].launched
        ):
            self._reduce(j)

    def _reduce(self, j):
        if not self.groups[j].split:
            return super()._reduce(j)
        g, state, n = self._launched(j), self.progress[j], self.axis.size
        out = torch.empty(g.shard_numel, dtype=self.grad_dtype, device=g.device)
        bucket = (
            state.bucket
            if state.bucket is not None
            else torch.zeros(g.padded, dtype=self.grad_dtype, device=g.device)
        )
        state.bucket = None  # alive only until its reduce-scatter finishes (the closure holds it)
        mean = self.to_params and n > 1  # the caller's optimizer reads the mean (x / 2^k is exact)
        scatter = self.scatter or (lambda out, t: self.axis.start("reduce_scatter", out, t))
        self._start(
            scatter(out, bucket),
            lambda: (g.grad.add_(out.div_(n) if mean else out), bucket),
        )
        if self.after_reduce is not None:
            self.after_reduce(g)

    def _start(self, work, finish):
        super()._start(work, finish)
        while len(self._pending) > MAX_IN_FLIGHT:  # the transient buckets: at most this many alive
            self._finish_one()

    def zero_grad(self):
        """As ddp.GradBuckets.zero_grad; a group holding only a shard of its parameters (ZeRO-3)
        frees gradient (allocated again by the next backward) unless the caller's optimizer reads
        it."""
        self._settle()
        for g, state in zip(self.groups, self.progress):
            state.reduced = False
            if g.shard is not None and g.split and not self.to_params:
                g.grad = None
            elif g.grad is not None:
                g.grad.zero_()


class Buckets:
    """The buckets of several replica groups (zero_rules.Replicas), each over its own axis, as one."""

    def __init__(self, parts):
        self.parts = parts
        self.groups = [g for part in parts for g in part.groups]
        self.progress = [state for part in parts for state in part.progress]

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.no_sync())
            yield

    def finish(self):
        for part in self.parts:
            part.finish()

    def zero_grad(self):
        for part in self.parts:
            part.zero_grad()
