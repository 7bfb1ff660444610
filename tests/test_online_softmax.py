"""Lesson 12's tiled attention (lessons/12_flash.py:flash_forward): the online softmax, one tile of
scores at a time, equals float64 softmax attention over all keys, and so does its log-sum-exp. One
process, small shapes; these are also the `flash` exercise's tests (lessons/grade.py).

The bound (tests/tolerance.py's terms, lesson 12's derivation): a score is a d-term dot product, off
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
lesson = importlib.import_module("12_flash")  # the exercise's substitution, when graded

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


# (s, block): four tiles a row, three of 16
@pytest.mark.parametrize("s, block", [(32, 8), (48, 16)], ids=lambda x: str(x))
def test_tiled_backward_equals_softmax_attention_gradients(s, block):
    """lessons/12_flash.py:flash_backward (P recomputed from the saved lse, D = rowsum(dO O)): dq,
    dk, dv = float64 autograd of the causal softmax attention, within lesson 12's bound: each
    gradient is a sum of <= s products whose factors carry the forward's relative error rel (on P
    and on D): (2 rel + likely(s)) x the same sum taken in absolute values."""
    torch.manual_seed(1)
    q, k, v = (2 * torch.randn(B, A, s, D) for _ in range(3))
    dout = torch.randn(B, A, s, D)
    # the forward's out and lse from the float64 reference, rounded to fp32: only backward graded
    out, lse = (t.float() for t in reference(q, k, v))
    dq, dk, dv = lesson.flash_backward(q, k, v, out, lse, dout, block)

    # float64 autograd of the reference, and the sums of |terms| each gradient adds up
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    want_out, _ = reference(*ref)
    want_out.backward(dout.double())
    causal = ~torch.ones(s, s, dtype=torch.bool).tril()
    p = torch.softmax(
        (ref[0] @ ref[1].transpose(-1, -2) / math.sqrt(D)).masked_fill(causal, float("-inf")), -1
    ).detach()
    ds_abs = p * (dout.abs().double() @ v.abs().double().transpose(-1, -2))
    ds_abs = ds_abs + p * (dout.abs().double() * want_out.detach().abs()).sum(-1, keepdim=True)
    sums = {
        "dq": ds_abs @ k.abs().double() / math.sqrt(D),
        "dk": ds_abs.transpose(-1, -2) @ q.abs().double() / math.sqrt(D),
        "dv": p.transpose(-1, -2) @ dout.abs().double(),
    }

    u, tiles = unit_roundoff(torch.float32), s // block
    scores = (q.abs() @ k.abs().transpose(-1, -2)).max().item() / math.sqrt(D)
    rel = 2 * likely(D) * scores + (2 * tiles + 8) * u + 2 * likely(s)
    for name, got, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        bound = (2 * rel + likely(s)) * sums[name]
        assert_within(got, r.grad, bound, f"s={s} block={block}: {name}")
