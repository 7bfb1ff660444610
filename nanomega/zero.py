"""Data parallelism and ZeRO stages 0-3: one engine for any nn.Module and any element-wise torch.optim class.

Idea (Rajbhandari et al. 2020): N data-parallel ranks each run a replica on 1/N of the batch and average
their gradients. With Adam in mixed precision every rank then holds, per parameter, 2 (16-bit weight)
+ 2 (16-bit gradient) + 12 (fp32 master weight, Adam m and v) = 16 bytes. ZeRO stops replicating them:
    stage 0  DP: gradients all-reduced in buckets while backward runs          16        bytes/param/rank
    stage 1  optimizer state sharded: rank r updates 1/N, then all-gather       4 + 12/N
    stage 2  + gradients reduce-scattered to their owner, never kept whole      2 + 14/N
    stage 3  + parameters sharded, gathered per unit for forward and backward   16/N       (zero3.py)
Bytes one rank sends per step, Psi = gradient bytes (ring, dist.py): all-reduce 2(N-1)/N Psi for DP;
reduce-scatter (N-1)/N Psi + all-gather (N-1)/N Psi for stages 1-2, the same; stage 3 gathers the
parameters twice (forward and backward): 3(N-1)/N Psi, 1.5x DP.
Here gradients are accumulated and reduced in grad_dtype (fp32 by default: 2+4+12 = 18 bytes in bf16) and
the fp32 master copy IS the model's storage when the model is fp32 (4 + 4 + 8 = 16 bytes).
Lesson: lessons/02-data-parallel-and-zero.md
"""
import contextlib
import functools
import math
from collections import deque

import torch

from .flat import FlatGroup, split_by_size, storage_bytes
from .zero3 import ShardedParameters
from .zero_state import ShardedState

STAGES = (0, 1, 2, 3)
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
               torch.optim.Adadelta, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
               torch.optim.ASGD)
MAX_IN_FLIGHT = 2  # ZeRO-2/3: reductions launched but unfinished, each holding a full-gradient bucket alive
NORM_CHUNK = 2**20  # elements per fp64 chunk of the norm (a whole fp64 copy would cost 2x the gradient)


def check_config(stage, optimizer_cls):
    """One-line errors for a stage or an optimizer ZeRO cannot run, raised before any collective."""
    if stage not in STAGES:
        raise ValueError(f"--zero must be 0, 1, 2 or 3, got {stage!r}")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise ValueError(f"optimizer: a {type(optimizer_cls).__name__} is not a torch.optim.Optimizer class; pass "
                         f"e.g. torch.optim.AdamW (the class, not an instance)")
    name = optimizer_cls.__name__
    if optimizer_cls in (torch.optim.LBFGS, torch.optim.SparseAdam):
        raise ValueError(f"optimizer {name} cannot run under ZeroEngine (LBFGS needs a closure, SparseAdam "
                         f"sparse gradients); use AdamW, Adam or SGD")
    if stage and optimizer_cls not in ELEMENTWISE and not getattr(optimizer_cls, "elementwise", False):
        raise ValueError(f"--zero {stage}: optimizer {name} cannot be sharded: ZeRO steps 1-D slices of flat "
                         f"buffers, exact only for element-wise updates "
                         f"({', '.join(c.__name__ for c in ELEMENTWISE)}); use --zero 0 or one of those "
                         f"(or set {name}.elementwise = True if its update is element-wise)")


def weight_decay_groups(weight_decay, **options):
    """A param_groups_fn: weight decay on >= 2-D parameters (matrices, embeddings), none on biases and norms."""
    def groups(named_params):
        return [dict(params=[n for n, p in named_params if p.dim() >= 2], weight_decay=weight_decay, **options),
                dict(params=[n for n, p in named_params if p.dim() < 2], weight_decay=0.0, **options)]
    return groups


class ZeroEngine(ShardedState):
    """Owns the fp32 master weights, the gradient buffers and the optimizer of `model` over grid.dp.

    optim: optimizer kwargs (one group), or param_groups_fn(named trainable params) -> [dict(params=[names],
    **options)]. wrap (stage 3): the modules gathered as units (default zero3.default_wrap). shared: this
    pipeline stage's copy of the tied embedding (pp.tied_embedding): its gradient is summed over grid.embed.
    Use: forward/backward as usual (`with engine.no_sync():` on all but the last micro-batch), then step().
    """

    def __init__(self, model, optimizer_cls, optim, grid, stage=0, bucket_mb=25, grad_dtype=torch.float32,
                 wrap=None, shared=None):
        check_config(stage, optimizer_cls)
        if stage == 3 and grid.pp.size > 1:
            raise ValueError("--zero 3 with --pp > 1 would gather every parameter twice per micro-batch; use "
                             "--zero 1 or 2 with pipeline parallelism")
        named = list(model.named_parameters())  # tied parameters once, under their first name
        trainable = [(k, p) for k, p in named if p.requires_grad]
        if not trainable:
            raise ValueError("ZeroEngine: the model has no trainable parameters (all requires_grad=False)")
        self.module, self.grid, self.stage, self.axis = model, grid, stage, grid.dp
        self.grad_dtype, self.shared = grad_dtype, shared
        specs = self._param_groups(optim, trainable)  # before ZeRO-3 swaps the parameters for empty tensors
        self._no_sync, self._queued, self._pending = False, False, deque()
        n, rank = (grid.dp.size, grid.dp_rank) if stage else (1, 0)
        if stage == 3:
            self.sharded = ShardedParameters(model, named, grid.dp, wrap, self._queue_end_backward)
            self.groups = [g for g in self.sharded.groups if g.trainable]
        else:
            self.sharded = None
            buckets = split_by_size(trainable[::-1], bucket_mb * 2**20, [shared] if shared is not None else [])
            self.groups = [FlatGroup(b[::-1], n, rank) for b in buckets]  # in the order backward fills them
            for g in self.groups:
                g.full = g.flatten(g.params)  # the parameters become views of one padded buffer
                g.bind(g.full)
                g.own = g.full[g.lo:g.hi]
        for g in self.groups:
            g.master = g.own.float()  # fp32 model: the same tensor (no copy); 16-bit model: the fp32 master
            g.grad = torch.zeros(g.padded if stage < 2 else g.shard_numel, dtype=grad_dtype, device=g.device)
            g.grad_own = g.grad[g.lo:g.hi] if stage < 2 else g.grad  # the reduced gradient of the owned slice
            for i, p in enumerate(g.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, g, i))
        self.optimizer = self._build_optimizer(optimizer_cls, specs)

    def _param_groups(self, optim, trainable):
        specs = optim(trainable) if callable(optim) else [dict(params=[k for k, _ in trainable], **optim)]
        self.group_of = {}
        for j, spec in enumerate(specs):
            for k in spec["params"]:
                if k in self.group_of:
                    raise ValueError(f"param_groups_fn puts parameter {k} in two groups")
                self.group_of[k] = j
        missing = [k for k, _ in trainable if k not in self.group_of]
        if missing:
            raise ValueError(f"param_groups_fn leaves out trainable parameters {missing[:3]}; give each a group")
        return specs

    def _build_optimizer(self, optimizer_cls, specs):
        """The optimizer steps this rank's pieces (views of the fp32 masters); stage 0: whole parameters."""
        groups = [dict(spec, params=[]) for spec in specs]
        self.pieces = []  # (tensor the optimizer steps, its gradient in grad_dtype, group, index, a, b)
        for g in self.groups:
            for i, a, b in g.pieces():
                m, grad = g.master[a - g.lo:b - g.lo], g.grad_own[a - g.lo:b - g.lo]
                if self.stage == 0:  # whole parameters, shaped: shape-aware optimizers work too
                    m, grad = m.view(g.shapes[i]), grad.view(g.shapes[i])
                groups[self.group_of[g.names[i]]]["params"].append(m)
                self.pieces.append((m, grad, g, i, a, b))
        for group in groups:  # a rank owning nothing of a group steps an empty piece: same state keys on all
            if not group["params"]:
                empty = self.groups[0].master[:0]
                group["params"].append(empty)
                self.pieces.append((empty, self.groups[0].grad_own[:0], None, None, 0, 0))
        return optimizer_cls(groups)

    # ---- backward: gradients into grad_dtype buffers, reduced bucket by bucket while backward runs ----
    def _syncing(self):
        return self.stage >= 2 or not self._no_sync

    @contextlib.contextmanager
    def no_sync(self):
        """Backward without communication, gradients accumulate locally: stages 0 and 1. Stages 2 and 3 keep
        only a 1/N slice of the gradient, so they reduce-scatter every micro-batch anyway (into that slice)."""
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
        if self.stage >= 2 and g.bucket is None:
            g.bucket = torch.zeros(g.padded, dtype=self.grad_dtype, device=g.device)
        buf = g.bucket if self.stage >= 2 else g.grad
        buf[g.offsets[i]:g.offsets[i] + g.sizes[i]].view_as(p.grad).add_(p.grad)  # accumulate in grad_dtype
        p.grad = None  # the model-dtype gradient is dropped
        if self._syncing():
            g.arrived.add(i)
            self._launch_ready(g)

    def _launch_ready(self, g):
        """Stage 3 reduces a unit as soon as it is complete; stages 0-2 launch buckets in their index order,
        the same on every rank (collectives must match across ranks)."""
        if self.stage == 3:
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
        if self.stage == 0:  # the sum, then the mean, on every rank (a later synced backward adds to it)
            self._start(self.axis.start("all_reduce", g.grad), lambda: g.grad.div_(n))
            return
        out = torch.empty(g.shard_numel, dtype=self.grad_dtype, device=g.device)
        if self.stage == 1:  # owned slice := the sum over ranks; the rest (others' business) := 0
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
        while self.stage >= 2 and len(self._pending) > MAX_IN_FLIGHT:  # stages 0-1: no transient buffers
            self._finish_one()

    def _finish_one(self):
        work, finish = self._pending.popleft()
        if work is not None:
            work.wait()
        finish()

    def _end_backward(self):
        """Autograd's last callback: reduce what unused parameters held back (in index order), wait for every
        reduction (the next backward adds into the same buffers), reset."""
        self._queued = False
        if self._syncing():
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

    # ---- the step ----
    def set_lr(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, clip_norm=None, scaler=None, skip=False):
        """Finish the reductions, average (and unscale), global norm, clip, step the owned pieces, write the
        parameters back (all-gather for stages 1-2), zero the gradients. -> dict(grad_norm, stepped).
        skip=True drops the update (a loss spike, faults.Spikes) like a non-finite one."""
        for g in self.groups:  # every micro-batch ran under no_sync (or none ran): reduce now
            if not g.reduced:
                self._reduce(g)
        while self._pending:
            self._finish_one()
        for g in self.groups:
            if self.stage:  # stage 0 averaged already; the shards hold sums
                g.grad_own.div_(self.axis.size)
            if scaler is not None and scaler.scale != 1.0:
                g.grad_own.mul_(1.0 / scaler.scale)
            if self.shared is not None and g.params[0] is self.shared:
                self.grid.embed.all_reduce(g.grad_own)  # both pipeline copies take the summed gradient
        for m, grad, *_ in self.pieces:
            m.grad = grad.float()  # the gradient itself when grad_dtype is fp32
        norm = self._global_grad_norm()
        stepped = math.isfinite(norm) or scaler is None
        if scaler is not None:
            scaler.update(not stepped)
        stepped = stepped and not skip
        if stepped:
            if clip_norm is not None and clip_norm / (norm + 1e-6) < 1.0:
                for m, *_ in self.pieces:
                    m.grad.mul_(clip_norm / (norm + 1e-6))
            self.optimizer.step()
            self._write_back()
        for g in self.groups:
            g.grad.zero_()
            g.reduced = False
        return dict(grad_norm=norm, stepped=stepped)

    def _global_grad_norm(self):
        """sqrt(sum g^2) over every unique parameter of the model: tp duplicates (not p.tensor_parallel)
        counted on tp rank 0 only, the last stage's shared_embedding copy not at all; summed over dp (sharded
        stages), tp and pp. In fp64, so the sum's order does not matter at fp32 precision."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.groups[0].device)
        for m, _, g, i, _, _ in self.pieces:
            p = g.params[i] if g is not None else None
            if p is not None and (self.grid.tp_rank == 0 or getattr(p, "tensor_parallel", False)) \
                    and not getattr(p, "shared_embedding", False):
                for chunk in m.grad.reshape(-1).split(NORM_CHUNK):
                    chunk = chunk.double()
                    sq += torch.dot(chunk, chunk)
        if self.stage:
            self.axis.all_reduce(sq)
        self.grid.tp.all_reduce(sq)
        self.grid.pp.all_reduce(sq)
        return sq.sqrt().item()

    def _write_back(self):
        """Updated fp32 masters -> the model's parameters in their dtype; stages 1-2 all-gather the slices."""
        works = []
        for g in self.groups:
            if g.master is not g.own:
                g.own.copy_(g.master)
            if self.stage in (1, 2):
                works.append(self.axis.start("all_gather", g.full, g.own))  # in place: own is full's slice
        for w in works:
            if w is not None:
                w.wait()

    def memory_bytes(self):
        """Bytes this rank holds now, from the tensors allocated (each storage counted once)."""
        seen, groups = set(), self.groups + (self.sharded.frozen if self.sharded else [])
        frozen = [p for p in self.module.parameters() if not p.requires_grad] if self.stage < 3 else []
        params = storage_bytes([g.full for g in groups] + [getattr(g, "shard", None) for g in groups] + frozen, seen)
        grads = storage_bytes([g.grad for g in self.groups] + [g.bucket for g in self.groups], seen)
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        optimizer = storage_bytes([g.master for g in self.groups] + state, seen)
        return dict(params=params, grads=grads, optimizer=optimizer)
