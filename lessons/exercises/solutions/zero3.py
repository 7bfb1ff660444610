"""Solution of the zero3 exercise: nanomega/zero3.py:ShardedParameters.gather and .release."""

import torch

from nanomega.flat import set_data


def gather(self, u, wait=True):
    for g in self.unit_groups[u]:
        if not self.gathered(g):  # storage back, all-gather the shards into it (asynchronously)
            g.full.untyped_storage().resize_(g.padded * g.full.element_size())
            if g.full.numel() != g.padded:  # the first gather: flat.py made `full` without storage
                g.full.set_(g.full.untyped_storage(), 0, (g.padded,))
            self.inflight[id(g)] = self.start_gather(g)

        if wait and id(g) in self.inflight:
            work = self.inflight.pop(id(g))
            if work is not None:
                work.wait()
            if self.wired(g.params[0]):  # the wire's format into the parameters' buffer
                self.wire.arrive(g)
            g.bind(g.full)


def release(self, g):
    work = self.inflight.pop(id(g), None)
    if work is not None:
        work.wait()
    for p in g.params:  # an empty tensor: a stray use fails loudly, not on freed memory
        set_data(p, torch.empty(0, dtype=g.dtype, device=g.device))
    g.full.untyped_storage().resize_(0)
    if self.wired(g.params[0]):
        self.wire.release(g)
