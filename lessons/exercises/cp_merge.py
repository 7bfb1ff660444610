"""Exercise cp-merge (lesson 07): context parallelism's online-softmax merge, and the head/tail
chunks that balance its causal work.

merge(acc, new): a query row's attention over two disjoint key sets, each already computed alone as
a pair (out, lse): `out` (b, nh, c, hd) fp32, the softmax-weighted values over that key set only, and
`lse` (b, nh, c) fp32, the log of that key set's sum of exp(score). Return the pair for the union of
the two key sets. acc is None for the first key set: return new. The invariants to build it from:
    - the union's lse is the log of the sum of the two sums of exp;
    - each part's output was normalized by its own sum: re-weight it by its share of the union's sum;
    - a row that no key has reached yet (documents) has lse = -inf: its share is 0, never NaN.
positions(s, cp, rank, balanced=True): the (s/cp,) token positions this rank holds, in order. The
sequence is cut into 2 cp equal chunks; a causal query attends to every key before it, so the
chunks late in the sequence cost more: with balanced=True a rank holds one chunk from the start and
its mirror from the end, so that every rank does the same work (lesson 07's picture). With
balanced=False rank r holds the r-th of cp contiguous pieces. A sequence that does not split evenly
is refused with ValueError("--cp {cp} needs --block-size {s} divisible by {n} (2 x cp chunks, head
and tail)") where n is the number of chunks.

Replaces nanomega/cp.py:merge and nanomega/cp.py:positions in the tests.
Grade:  python lessons/check.py --exercise cp-merge lessons/exercises/cp_merge.py
"""

import torch  # noqa: F401  (you will need it)


def merge(acc, new):
    raise NotImplementedError("exercise cp-merge: write the online-softmax merge")


def positions(s, cp, rank, balanced=True):
    raise NotImplementedError("exercise cp-merge: write the head/tail positions")
