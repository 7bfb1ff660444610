"""Context parallelism's two small pieces, in one process: the online-softmax merge (cp.merge) and the
head/tail chunks a rank holds (cp.positions). tests/test_cp.py runs them inside ring, all-gather and
Ulysses attention over spawned worlds; these fast checks are also the `cp-merge` exercise's tests
(lessons/grade.py).

The merge's bound (tests/tolerance.py's terms): a score is a d-term dot product, off by up to
likely(d) relative to sum |q_t k_t| scale; an error e in the scores moves a softmax weight by a
relative ~e, so the output by e max|v| per key set; each chunk's P V and its row sum are s-term sums
(likely(s) relative to max|v|); the merge itself adds a few roundings (exp, two products and a sum).
"""

import math

import pytest
import torch
from tolerance import assert_within, likely, unit_roundoff

from nanomega import cp

B, NH, S, HD = 2, 3, 12, 8


def full_attention(q, k, v, mask):
    """Float64 softmax(q k^T / sqrt(d)) v over all keys: the reference."""
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v.double()


def chunked(q, k, v, mask, cuts):
    """The same attention one key chunk at a time, each chunk's (out, lse) merged by cp.merge."""
    acc = None
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        part = cp.pair_forward(
            q, k[:, :, lo:hi], v[:, :, lo:hi], mask[..., lo:hi], q.shape[-1] ** -0.5
        )
        acc = cp.merge(acc, part)
    return acc


def bound(q, k, v):
    scores = (q.abs() @ k.abs().transpose(-2, -1)).max().item() * q.shape[-1] ** -0.5
    return (
        2 * likely(HD) * scores + 4 * likely(S) + 8 * unit_roundoff(torch.float32)
    ) * v.abs().max().item()


@pytest.mark.parametrize("cuts", [(0, 6, 12), (0, 4, 8, 12), (0, 1, 12), (0, 11, 12)], ids=str)
def test_merge_equals_softmax_over_both_key_sets(cuts):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, NH, S, HD) for _ in range(3))
    mask = torch.ones(S, S, dtype=torch.bool).tril()  # causal: early key chunks see every query
    out, lse = chunked(q, k, v, mask, cuts)
    assert_within(out, full_attention(q, k, v, mask), bound(q, k, v), "merged output")
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(HD)
    want = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1)
    # the lse is off by the scores' error (absolute) plus the log-sum's roundings
    score_error = 2 * likely(HD) * scores.abs().max().item()
    assert_within(lse, want, score_error + 4 * likely(S), "merged log-sum-exp")


def test_merge_of_a_row_no_key_reached_is_zero_not_nan():
    # documents: a query whose document starts after the chunk's keys sees none of them (lse -inf)
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 1, 4, HD) for _ in range(3))
    docs = torch.tensor([0, 0, 1, 1])
    mask = docs[:, None] == docs[None, :]
    out, lse = chunked(q, k, v, mask, (0, 2, 4))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_within(out, full_attention(q, k, v, mask), bound(q, k, v), "documents")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_positions_are_a_head_chunk_and_its_mirror_tail(n):
    s = 16 * n
    held = [cp.positions(s, n, rank).tolist() for rank in range(n)]
    assert sorted(sum(held, [])) == list(range(s))  # every token once
    size = s // (2 * n)
    for rank, mine in enumerate(held):
        head, tail = rank, 2 * n - 1 - rank
        want = [*range(head * size, (head + 1) * size), *range(tail * size, (tail + 1) * size)]
        assert mine == want, f"cp={n} rank={rank}: got {mine}, want {want}"
    # contiguous (unbalanced): rank r holds the r-th s/cp tokens
    assert cp.positions(s, n, n - 1, balanced=False).tolist() == list(range(s - s // n, s))


def test_positions_refuse_a_sequence_that_does_not_split_in_one_line():
    with pytest.raises(ValueError, match=r"--cp 2 needs --block-size 18 divisible by 4"):
        cp.positions(18, 2, 0)
