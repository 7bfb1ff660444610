"""MoE's balance loss (nanomega/moe.py:balance_loss): the Switch/GShard loss E sum_e f_e P_e taken
per sequence, the unit no layout splits (lesson 16). One process, small shapes; with
tests/test_hf_deepseek.py's DeepSeek-V3 sequence-wise loss and tests/test_routers.py's transformers
loss these are also the `balance` exercise's tests (lessons/grade.py).

Claims:
    value     per sequence, against the definition written out one sequence and one expert at a
              time in float64 (f_e: the sequence's assignments to e over its s k; P_e: the mean of
              e's probability over its s tokens): three sequences routed differently; 1 when
              probabilities and assignments are even; E when one expert takes everything
    gradient  through the probabilities only (f is a count): d loss / d probs[b, t, e] = E f_b,e / s
The bound: an s-term mean and an E-term sum of products, gamma(s + E + 2) relative to the sum of
|terms| (Higham's worst case; small n).
"""

import pytest
import torch
from tolerance import assert_within, gamma

from nanomega import moe

E, K, S = 4, 2, 8


def definition(probs, experts, n_experts):
    """E sum_e f_e P_e for each sequence, one sequence and one expert at a time, in float64."""
    b, s, k = experts.shape
    out = []
    for seq in range(b):
        total = 0.0
        for e in range(n_experts):
            f = (experts[seq] == e).sum().item() / (s * k)  # share of the sequence's assignments
            p = probs[seq, :, e].double().mean().item()  # mean router probability
            total += f * p
        out.append(n_experts * total)
    return torch.tensor(out, dtype=torch.float64)


def routed(seed):
    """Three sequences, each routed by its own random logits (the top-k of a softmax)."""
    logits = 3 * torch.randn(3, S, E, generator=torch.Generator().manual_seed(seed))
    probs = logits.softmax(-1)
    return probs, probs.topk(K, dim=-1).indices


def even():
    """Even probabilities, every expert chosen s k / E times: the balanced extreme."""
    return torch.full((1, S, E), 1 / E), (torch.arange(S * K).view(1, S, K) % E)


def collapsed():
    """One expert gets every assignment and all the probability: the other extreme."""
    probs = torch.zeros(1, S, E)
    probs[..., 0] = 1.0
    return probs, torch.zeros(1, S, K, dtype=torch.long)


CASES = {
    "three sequences routed differently": (*routed(0), None),
    "even probabilities and loads": (*even(), 1.0),
    "one expert takes everything": (*collapsed(), float(E)),
}


@pytest.mark.parametrize("case", CASES)
def test_balance_loss_is_switchs_per_sequence(case):
    probs, experts, extreme = CASES[case]
    got = moe.balance_loss(probs, experts, E)
    want = definition(probs, experts, E)
    if extreme is not None:
        assert want.tolist() == [extreme]  # the test's own definition at the extremes
    assert got.shape == want.shape, (
        f"{case}: got shape {tuple(got.shape)}, want {tuple(want.shape)}"
    )
    bound = gamma(S + E + 2) * want.abs() + 1e-12
    shown = [[round(x, 4) for x in t.tolist()] for t in (got, want)]
    assert_within(got, want, bound, f"{case}: got {shown[0]}, want {shown[1]}")


def test_balance_loss_gradient_reaches_the_router_probabilities():
    """Only P carries a gradient (f is a count): d loss_b / d probs[b, t, e] = E f_b,e / s."""
    probs, experts, _ = CASES["three sequences routed differently"]
    probs = probs.clone().requires_grad_()
    moe.balance_loss(probs, experts, E).sum().backward()
    f = torch.nn.functional.one_hot(experts.flatten(1), E).sum(1).double() / (S * K)  # (b, E)
    want = (E * f / S)[:, None, :].expand(-1, S, -1)  # (b, s, E)
    got = probs.grad if probs.grad is not None else torch.zeros_like(want)
    assert_within(
        got,
        want,
        gamma(S + 4) * want.abs() + 1e-12,
        f"d loss / d probs[0, 0]: got {got[0, 0].tolist()}, want {want[0, 0].tolist()}",
    )
