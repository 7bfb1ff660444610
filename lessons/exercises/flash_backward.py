"""Exercise flash-backward (lesson 12): FlashAttention-2's backward, one tile of scores at a time.

flash_backward(q, k, v, out, lse, dout, block): q, k, v, out, dout (b, a, s, d), lse (b, a, s)
(what lessons/12_flash.py:flash_forward returns and FlashAttention saves), s divisible by block.
Return (dq, dk, dv), the gradients of the causal softmax(q k^T / sqrt(d)) v for the output's
gradient dout. The probabilities P were never stored; build them back, one (block x block) tile at
a time, over the tiles a causal kernel computes (lessons/12_flash.py:tiles(s, block)), with
tile_scores(q, k, i, j, block) (scaled, masked on the diagonal). The invariants to build it from:
    - lse is each row's log of the sum of exp(score) over the keys it sees: from one tile of scores
      and its rows' lse, that tile's probabilities follow with no max and no row sum (masked
      scores give exactly 0);
    - out = P v, so v's gradient is a sum over query rows, and P's gradient a product with v;
    - the softmax's backward needs, per row, sum_j P_ij dP_ij, which one tile does not have; it
      equals a row sum over d of two tensors you were given, so compute it once, before the tiles;
    - a score is q k / sqrt(d): the 1 / sqrt(d) reaches both q's and k's gradients;
    - each (i, j) tile adds to the rows of dq of query block i, and to dk, dv of key block j.

Replaces lessons/12_flash.py:flash_backward in the tests (tests/test_online_softmax.py: dq, dk, dv
equal to float64 autograd within a bound from the arithmetic; 4 and 3 tiles a row).
Grade:  python lessons/check.py --exercise flash-backward lessons/exercises/flash_backward.py
"""

import importlib
import math  # noqa: F401  (you will need it)

import torch  # noqa: F401  (you will need it)

# lessons/12_flash.py's tiles and tile of scores (the grader puts lessons/ on the path; a module
# whose name starts with a digit is imported by importlib)
lesson = importlib.import_module("12_flash")
tiles, tile_scores = lesson.tiles, lesson.tile_scores


def flash_backward(q, k, v, out, lse, dout, block):
    raise NotImplementedError("exercise flash-backward: recompute P from lse, tile by tile")
