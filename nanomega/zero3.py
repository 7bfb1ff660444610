"""ZeRO-3: the parameters sharded too, each unit gathered just before its forward and its backward.

A wrap policy cuts the model into units (default: each direct child; a ModuleList/ModuleDict stands
for its children). Hooks gather a unit before its forward and free it after, gather it again when
backward reaches its outputs, reduce-scatter its gradients (zero_buckets.py) and free it; the next
unit is prefetched. A parameter used by several units (a tied embedding) belongs to the root unit.
    memory per rank  16/N bytes per parameter + the gathered units (current + prefetched)
    bytes per step   all-gather (N-1)/N Psi twice (forward, backward) + reduce-scatter (N-1)/N Psi
                     = 3 (N-1)/N Psi = 1.5x data parallelism's all-reduce
    offload_params   + 2 x 2 Psi/N bytes host -> device per step (bf16 model: each gather's shard),
                     uploaded on a side stream with the all-gather behind it: a prefetch's copy
                     overlaps the current unit's compute (which waits only when it needs the unit)
    wire             parameters gathered in another format (fp8_gather.py: the FP8 linear's
                     weights as 1-byte codes + scales, half of bf16's all-gather bytes; zeropp.py's
                     qwZ: int8/int4 blocks)
    secondary        hpZ (zeropp.py): each gathered unit's slice over this smaller axis (the host's
                     ranks) kept from forward to backward, whose all-gather then stays inside
Limits: a parameter is used only inside its unit's forward (or sits in the root); activation
recompute must be non-reentrant (torch.utils.checkpoint(use_reentrant=False), as recompute.py does).
Lesson: lessons/04-data-parallel-and-zero.md
"""

import contextlib
import functools

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .ddp import start_equal
from .flat import FlatGroup, set_data
from .zero_buckets import ShardBuckets


def default_wrap(model):
    """The units: each direct child; a container (ModuleList/ModuleDict, never called) stands for
    its children."""

    def expand(m):
        return (
            [u for c in m.children() for u in expand(c)]
            if isinstance(m, (nn.ModuleList, nn.ModuleDict))
            else [m]
        )

    return [u for child in model.children() for u in expand(child)]


class ShardedParameters:
    """The units of a model, their parameter shards (flat groups keeping only this rank's slice),
    and the hooks that gather, free and prefetch them. Between uses a group is free; `inflight`
    holds its running all-gather; once that is waited for, the parameters are views of the gathered
    buffer. A model built on the meta device never holds more: values (meta.Init.values) draws each
    shard on `device` (flat.FlatGroup)."""

    def __init__(
        self,
        model,
        named,
        axis,
        wrap=None,
        values=None,
        device=None,
        host=False,
        wire=None,
        secondary=None,
    ):
        # host: parameter offload (ZeRO-Infinity's offload_param): every shard in host memory,
        # copied up at each gather, `uploaded` bytes in all; on a CPU-only machine the same copies,
        # host to host
        self.axis, self.host, self.uploaded, self.stream = axis, host, 0, None
        # wire: another format on the wire for the parameters it takes (fp8_gather.FP8Gather):
        # they get groups of their own, gathered by its start / arrive / release
        self.wire = wire
        # secondary (hpZ): an Axis inside the host; copies: id(group) -> this rank's 1/S slice of
        # the gathered unit, from its forward to its backward; via: gathers running over it
        self.secondary, self.copies, self.via = secondary, {}, set()

        # the units: the root, then each wrapped module
        modules = [model] + [
            m
            for m in (wrap(model) if callable(wrap) else wrap or default_wrap(model))
            if m is not model
        ]
        self.units = list({id(m): m for m in modules}.values())  # the root (the model) first

        owner = self._owners(model, named)
        self.groups, self.unit_groups, self.inflight = [], [], {}
        for u in range(len(self.units)):
            mine = [(k, p) for k, p in named if owner[k] == u]
            # one flat group per kind
            kinds = list(dict.fromkeys(self._kind(p) for _, p in mine))
            groups = [
                FlatGroup(
                    [(k, p) for k, p in mine if self._kind(p) == kind],
                    axis.size,
                    axis.rank,
                    split=True,
                    keep="shard",
                    values=values,
                    device=device,
                    host=host,
                )
                for kind in kinds
            ]
            for g in groups:
                self.release(g)
            self.unit_groups.append(groups)
            self.groups += groups

        self.frozen = [g for g in self.groups if not g.trainable]
        self.order, self.previous, self.post, self.visited, self.in_backward = (
            [],
            [],
            [],
            set(),
            False,
        )

        # each unit gathered before its forward, released after it
        for u, m in enumerate(self.units):
            m.register_forward_pre_hook(functools.partial(self._pre_forward, u))
            m.register_forward_hook(functools.partial(self._post_forward, u))

    def _kind(self, p):
        """Parameters of one kind share a flat group: dtype, trainable, and the wire's format."""
        return p.dtype, p.requires_grad, self.wired(p)

    def wired(self, p):
        return self.wire is not None and self.wire.takes(p)

    def _owners(self, model, named):
        """Each parameter's unit: the innermost unit holding every module it is registered in, else
        the root."""
        subtree = [set(map(id, m.modules())) for m in self.units]
        uses = {}
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None:
                    inner = min(
                        (u for u in range(len(self.units)) if id(m) in subtree[u]),
                        key=lambda u: len(subtree[u]),
                    )
                    uses.setdefault(id(p), set()).add(inner)
        return {k: (next(iter(uses[id(p)])) if len(uses[id(p)]) == 1 else 0) for k, p in named}

    # ---- gather / free ----
    @staticmethod
    def gathered(g):
        return g.full.untyped_storage().nbytes() > 0

    def gather(self, u, wait=True):
        for g in self.unit_groups[u]:
            if not self.gathered(g):  # storage back, all-gather the shards into it (asynchronously)
                g.full.untyped_storage().resize_(g.padded * g.full.element_size())
                # the first gather: flat.py made `full` without storage
                if g.full.numel() != g.padded:
                    g.full.set_(g.full.untyped_storage(), 0, (g.padded,))

                self.inflight[id(g)] = self.start_gather(g)

            if wait and id(g) in self.inflight:
                work = self.inflight.pop(id(g))
                if work is not None:
                    work.wait()
                if id(g) in self.via:  # the secondary copies hold the values already
                    self.via.discard(id(g))
                elif self.wired(g.params[0]):  # the wire's format into the parameters' buffer
                    self.wire.arrive(g)
                if self.secondary is not None and not self.in_backward and torch.is_grad_enabled():
                    self.copies[id(g)] = self.secondary_slice(g).clone()  # (padded / S,)
                g.bind(g.full)

    def start_gather(self, g):
        """The all-gather of g's shards into g.full (running); under parameter offload the host
        shard goes up into its own slice first, and the all-gather runs in place behind it; the
        wire's groups: its own all-gather (its `arrive` fills g.full); in backward, a group with a
        secondary copy (hpZ): the all-gather of the copies, inside the host."""
        if self.in_backward and id(g) in self.copies:
            self.via.add(id(g))
            return self.secondary.start("all_gather", g.full, self.copies[id(g)])
        if self.wired(g.params[0]):
            return self.wire.start(g, self.axis)
        if not self.host:
            return self.axis.start("all_gather", g.full, g.shard)
        mine = g.full[g.lo : g.hi]
        with self.uploading(g.device):
            mine.copy_(g.shard, non_blocking=True)  # pinned: asynchronous
            work = self.axis.start("all_gather", g.full, mine)
        self.uploaded += g.shard.numel() * g.shard.element_size()
        return work

    def secondary_slice(self, g):
        """This rank's 1/S of the gathered buffer on the secondary axis (S divides N, so P)."""
        n = g.padded // self.secondary.size
        return g.full[self.secondary.rank * n : (self.secondary.rank + 1) * n]

    @contextlib.contextmanager
    def uploading(self, device):
        """On a GPU, the upload stream made current: it first waits for the compute stream (which
        allocated the slice), then takes the copy and the all-gather issued behind it (NCCL waits
        for the stream current at the call); the compute stream waits only at the gather's
        work.wait(), when the unit is needed. On a CPU: host-to-host copies, in order."""
        if device.type != "cuda":
            yield
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            yield

    def release(self, g):
        """Free a group's gathered parameters (its shard stays)."""
        work = self.inflight.pop(id(g), None)
        if work is not None:
            work.wait()
        self.via.discard(id(g))
        # an empty tensor: a stray use outside the unit fails loudly, not on freed memory
        for p in g.params:
            set_data(p, torch.empty(0, dtype=g.dtype, device=g.device))
        g.full.untyped_storage().resize_(0)
        if self.wired(g.params[0]):
            self.wire.release(g)

    def _release_unit(self, u):
        for g in self.unit_groups[u]:
            if self.gathered(g):
                self.release(g)

    # ---- hooks ----
    def _pre_forward(self, u, module, args):
        if self.in_backward:  # a recompute inside backward: the unit is gathered already
            return self.gather(u)
        if u == 0:  # a new forward of the whole model
            self.previous, self.order, self.post = self.order or self.previous, [], []
        self.order.append(u)
        self.gather(u)
        k = len(self.order) - 1  # prefetch the unit that followed this one in the previous forward
        if k + 1 < len(self.previous) and self.previous[k] == u:
            self.gather(self.previous[k + 1], wait=False)

    def _post_forward(self, u, module, args, output):
        if self.in_backward:
            return
        self.post.append(u)
        if torch.is_grad_enabled():  # backward reaches this unit when its outputs' gradients arrive
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, u))
        self._release_unit(u)

    def _pre_backward(self, u, grad):
        if not self.in_backward:
            # units finish backward in reverse
            self.in_backward, self.backward_order = True, self.post[::-1]
            # once autograd is done
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        if u in self.visited:
            return
        self.visited.add(u)
        self.gather(u)
        nxt = (
            self.backward_order.index(u) + 1
            if u in self.backward_order
            else len(self.backward_order)
        )
        if nxt < len(self.backward_order):
            self.gather(self.backward_order[nxt], wait=False)

    def end_backward(self):
        for u in range(len(self.units)):
            self._release_unit(u)
        self.in_backward = False
        self.visited.clear()
        self.copies.clear()  # hpZ: the next forward makes new ones from the stepped weights


class FullyShardedDataParallel:
    """ZeRO-3 for the caller's own optimizer, as FSDP2's fully_shard allows: the parameters live as
    1/N shards and units are gathered on demand; parameters() are this rank's 1-D slices of the
    trainable parameters (views of the shards), each with a .grad (a view of the gradient shard)
    holding the mean gradient after every backward, accumulated over micro-batches. Element-wise
    optimizers only (a slice is stepped alone); the optimizer steps the shards in the model's dtype
    (no fp32 masters: zero.ZeroEngine(stage=3) has them).
    Use: opt = torch.optim.AdamW(fsdp.parameters()); forward/backward; opt.step();
    fsdp.zero_grad()."""

    def __init__(self, model, grid, wrap=None, init="verify"):
        named = list(model.named_parameters())  # tied parameters once, under their first name
        start_equal(model, grid.dp, init)  # before the parameters are sharded
        self.module, self.grid = model, grid
        self.sharded = ShardedParameters(model, named, grid.dp, wrap)
        groups = [g for g in self.sharded.groups if g.trainable]
        if len({g.dtype for g in groups}) != 1:
            raise ValueError("FullyShardedDataParallel: trainable parameters of one dtype only")
        self.buckets = ShardBuckets(
            groups,
            grid.dp,
            groups[0].dtype,
            in_order=False,
            after_reduce=self.sharded.release,
            to_params=True,
        )
        self.slices = [(g, a - g.lo, b - g.lo) for g in groups for _, a, b in g.pieces()]
        self.shards = [g.shard[a:b] for g, a, b in self.slices]
        self.zero_grad()

    def parameters(self):
        return list(self.shards)

    def zero_grad(self):
        """Gradients at zero, each shard's .grad a view of them again (an optimizer's zero_grad
        drops it)."""
        self.buckets.zero_grad()
        for t, (g, a, b) in zip(self.shards, self.slices):
            t.grad = g.grad[a:b]
