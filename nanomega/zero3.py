"""ZeRO-3: the parameters are sharded too, gathered per unit just before its forward and its backward.

Idea: a wrap policy cuts the model into units (default: each direct child, a ModuleList/ModuleDict
standing for its children -- for the GPT: embed, every block, head). Each unit's parameters live as 1/N
shards (flat.py). A forward pre-hook all-gathers the unit, a forward hook frees it, a hook on the unit's
outputs gathers it again when backward reaches it, and once all its gradients are in, they are
reduce-scattered (zero.py) and the unit is freed. The next unit is prefetched while this one computes.
Freeing resizes the flat buffer's storage to 0 bytes: the views autograd saved in forward (weight.t() ...)
point into that storage, so the re-gather in backward refills exactly what they read.
A parameter used by several units (a tied embedding) belongs to the root unit (the model itself), gathered
for the whole forward and again for the whole backward.

    memory per rank  16/N bytes per parameter + the gathered units (current + prefetched)
    bytes per step   all-gather (N-1)/N Psi twice (forward, backward) + reduce-scatter (N-1)/N Psi
                     = 3 (N-1)/N Psi = 1.5x data parallelism's all-reduce
Limits: a parameter must be used only inside the forward of its unit (or sit in the root); activation
recompute must be non-reentrant (torch.utils.checkpoint(use_reentrant=False), as recompute.py does).
Lesson: lessons/02-data-parallel-and-zero.md
"""
import functools

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .flat import FlatGroup

FREE, INFLIGHT, LIVE = "free", "inflight", "live"


def default_wrap(model):
    """The units: each direct child; a container (ModuleList/ModuleDict, never called) stands for its children."""
    def expand(m):
        return [u for c in m.children() for u in expand(c)] if isinstance(m, (nn.ModuleList, nn.ModuleDict)) else [m]
    return [u for child in model.children() for u in expand(child)]


class ShardedParameters:
    """The units of a model, their parameter shards, and the hooks that gather/free/prefetch them."""

    def __init__(self, model, named, axis, wrap, queue_end_backward):
        self.axis, self.queue_end_backward = axis, queue_end_backward
        modules = [model] + [m for m in (wrap(model) if callable(wrap) else wrap or default_wrap(model))
                             if m is not model]
        self.units = list({id(m): m for m in modules}.values())  # the root (the model) first
        owner = self._owners(model, named)
        self.groups, self.unit_groups = [], []
        for u in range(len(self.units)):
            mine = [(k, p) for k, p in named if owner[k] == u]
            kinds = list(dict.fromkeys((p.dtype, p.requires_grad) for _, p in mine))  # one flat group per kind
            groups = [FlatGroup([(k, p) for k, p in mine if (p.dtype, p.requires_grad) == kind], axis.size,
                                axis.rank) for kind in kinds]
            for g in groups:
                g.shard = g.own = g.flatten(g.params)[g.lo:g.hi].clone()  # the persistent 1/N
                g.full = torch.empty(g.padded, dtype=g.dtype, device=g.device)
                g.state, g.work = LIVE, None
                self.release(g)
            self.unit_groups.append(groups)
            self.groups += groups
        self.frozen = [g for g in self.groups if not g.trainable]
        self.order, self.previous, self.post, self.visited, self.in_backward = [], [], [], set(), False
        for u, m in enumerate(self.units):
            m.register_forward_pre_hook(functools.partial(self._pre_forward, u))
            m.register_forward_hook(functools.partial(self._post_forward, u))

    def _owners(self, model, named):
        """Each parameter's unit: the innermost unit holding every module it is registered in, else the root."""
        subtree = [set(map(id, m.modules())) for m in self.units]
        uses = {}
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None:
                    inner = min((u for u in range(len(self.units)) if id(m) in subtree[u]),
                                key=lambda u: len(subtree[u]))
                    uses.setdefault(id(p), set()).add(inner)
        return {k: (next(iter(uses[id(p)])) if len(uses[id(p)]) == 1 else 0) for k, p in named}

    # ---- gather / free ----
    def gather(self, u, wait=True):
        for g in self.unit_groups[u]:
            if g.state == FREE:  # storage back, all-gather the shards into it (asynchronously)
                g.full.untyped_storage().resize_(g.padded * g.full.element_size())
                g.work, g.state = self.axis.start("all_gather", g.full, g.shard), INFLIGHT
            if wait and g.state == INFLIGHT:
                if g.work is not None:
                    g.work.wait()
                g.work, g.state = None, LIVE
                g.bind(g.full)

    def release(self, g):
        if g.state == INFLIGHT and g.work is not None:
            g.work.wait()
        for p in g.params:  # an empty tensor: a stray use outside the unit fails loudly, not on freed memory
            p.data = torch.empty(0, dtype=g.dtype, device=g.device)
        g.full.untyped_storage().resize_(0)
        g.work, g.state = None, FREE

    def _release_unit(self, u):
        for g in self.unit_groups[u]:
            if g.state != FREE:
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
            self.in_backward, self.backward_order = True, self.post[::-1]  # units finish backward in reverse
            self.queue_end_backward()
        if u in self.visited:
            return
        self.visited.add(u)
        self.gather(u)
        nxt = self.backward_order.index(u) + 1 if u in self.backward_order else len(self.backward_order)
        if nxt < len(self.backward_order):
            self.gather(self.backward_order[nxt], wait=False)

    def end_backward(self):
        for u in range(len(self.units)):
            self._release_unit(u)
        self.in_backward = False
        self.visited.clear()
