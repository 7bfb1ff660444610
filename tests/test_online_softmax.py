"""Lesson 16's tiled attention (lessons/16_flash.py:flash_forward): the online softmax, one tile of
scores at a time, equals float64 softmax attention over all keys, and so does its log-sum-exp. One
process, small shapes; these are also the `flash` exercise's tests (lessons/grade.py).

The bound (tests/tolerance.py's terms, lesson 16's derivation): a score is a d-term dot product, off
by likely(d) relative to sum |q_t k_t| / sqrt(d); a score error e moves a softmax weight by a
relative ~2e (numerator and row sum), so the output by 2e max|v|; each of the T key tiles rescales
l and acc once (2T roundings); the row sums of P and of P v are s-term sums (likely(s) each); exp
and the final division a few roundings more.
"""

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch
from tolerance import assert_within, likely, unit_roundoff

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lessons"))
lesson = importlib.import_module("16_flash")  # the exercise's substitution, when graded

B, A, D = 2, 2, 8


def reference(q, k, v):
    """Float64 causal softmax(q k^T / sqrt(d)) v and each row's log-sum-exp."""
    s = q.shape[-2]
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


# (s, block): four tiles a row, one tile (no rescale ever needed), three tiles of 16
@pytest.mark.parametrize("s, block", [(32, 8), (32, 32), (48, 16)], ids=lambda x: str(x))
def test_tiled_forward_equals_softmax_attention(s, block):
    torch.manual_seed(0)
    # scores of a few units: a later key tile often raises a row's max, so the rescale is exercised
    q, k, v = (2 * torch.randn(B, A, s, D) for _ in range(3))
    out, lse = lesson.flash_forward(q, k, v, block)
    want_out, want_lse = reference(q, k, v)

    u, tiles = unit_roundoff(torch.float32), s // block
    scores = (q.abs() @ k.abs().transpose(-1, -2)).max().item() / math.sqrt(D)
    rel = 2 * likely(D) * scores + (2 * tiles + 8) * u + 2 * likely(s)
    case = f"s={s} block={block}: output"
    assert_within(out, want_out, rel * v.abs().max().item(), case)
    assert_within(lse, want_lse, likely(D) * scores + 2 * tiles * u + likely(s), f"{case}'s lse")
