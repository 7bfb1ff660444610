"""Exercise zero3 (lesson 04): ZeRO-3's gather and free, the two moves that keep 1/N of the
parameters on a rank between uses.

nanomega/zero3.py:ShardedParameters cuts the model into units (the root, then each block) and hooks
them: gather(u) before unit u's forward (and again when backward reaches it), release after. Each
unit's parameters live in flat groups (nanomega/flat.py:FlatGroup, exercise flat), self.unit_groups[u]:
    g.shard          this rank's slice, always kept
    g.full           the whole padded buffer (g.padded elements of g.dtype); its STORAGE exists only
                     while the unit is gathered (ShardedParameters.gathered(g): storage bytes > 0)
    g.params         the nn.Parameters; g.bind(g.full) makes them views of g.full
    self.inflight    {id(g): a running all-gather (a Work to .wait(), or None)}
Write the two methods (each takes `self`, a ShardedParameters):
    gather(self, u, wait=True)   every group of unit u gathered; wait=False (a prefetch) only starts
                                 the all-gathers
    release(self, g)             group g freed, its shard kept
The invariants to build them from:
    - between uses a rank holds the shards only: a freed group's g.full has 0 bytes of storage
      (g.full.untyped_storage().resize_(nbytes) gives it back or takes it away; the tensor object
      stays); the very first gather finds g.full with no elements at all: set it to the storage's
      (g.padded,) elements with g.full.set_(storage, 0, (g.padded,));
    - one all-gather per gather of a group: self.start_gather(g) starts it (given: it also handles
      parameter offload and FP8's wire format) and returns what to wait for;
    - nothing reads or frees g.full while its all-gather may still be writing it: wait first (a
      prefetch never used is waited for before it is freed);
    - a parameter is a view of g.full only between its gather and its release; after a release its
      data is an empty tensor of g.dtype on g.device (nanomega.flat.set_data(p, t)), so a stray use
      fails loudly instead of reading freed memory;
    - a group on FP8's wire (self.wired(g.params[0])) has two more steps: self.wire.arrive(g) once
      its all-gather is waited for, before binding; self.wire.release(g) when it is freed.
Replaces nanomega/zero3.py:ShardedParameters.gather and .release in the tests (tests/test_zero.py:
ZeRO-3 at two ranks bitwise equal to one process, its bytes and memory, one unit gathered ahead).
Grade:  python lessons/check.py --exercise zero3 lessons/exercises/zero3.py
"""

import torch  # noqa: F401  (you will need it)

from nanomega.flat import set_data  # noqa: F401  (you will need it)


def gather(self, u, wait=True):
    raise NotImplementedError("exercise zero3: write gather")


def release(self, g):
    raise NotImplementedError("exercise zero3: write release")
