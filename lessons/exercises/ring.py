"""Exercise ring (lesson 03): the ring all-reduce, built from point-to-point sends.

n ranks stand in a ring; rank r sends only to its right neighbour (r + 1) % n and receives only from
its left (r - 1) % n. ring_all_reduce(ax, x) leaves on every rank the sum over all ranks of x (fp32
or fp64, x.numel() divisible by n), and returns it (in place in x is fine). `ax` has ax.size (n),
ax.rank (r) and one call to move data: ax.p2p(sends=[(tensor, peer)], recvs=[(buffer, peer)]), which
sends and receives together (each side of a step must call it once: a send waits for its receive).
The invariants to build it from:
    - cut x into n chunks of B/n; every step, every rank sends ONE chunk to the right and receives
      one from the left;
    - reduce-scatter, n - 1 steps: at step t rank r sends chunk (r - t) mod n (what it has summed
      so far of it) and adds what it receives into the chunk its left neighbour sent; after n - 1
      steps rank r holds the full sum of one chunk;
    - all-gather, n - 1 steps: pass the finished chunks around, each received chunk copied over
      (not added);
    - every rank sends exactly 2 (n - 1) chunks: 2 (n - 1) / n x B bytes, whatever n (lesson 00's
      formula), so no rank sends a whole copy of x.
Send a copy of a chunk (tensor.clone()): the chunk itself may change while the send is in flight.

Replaces lessons/03_collectives.py:ring_all_reduce in the tests (lessons/diagrams.py runs it on
threads: the sum on every rank, and which chunk each rank sends at each step).
Grade:  python lessons/check.py --exercise ring lessons/exercises/ring.py
"""

import torch  # noqa: F401  (you will need it)


def ring_all_reduce(ax, x):
    raise NotImplementedError("exercise ring: write the ring all-reduce")
