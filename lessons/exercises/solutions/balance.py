"""Solution of the balance exercise: nanomega/moe.py:balance_loss."""

import torch.nn.functional as F


def balance_loss(probs, experts, n_experts, cp=None):
    b, s, k = experts.shape
    # (b, E): each sequence's share of its assignments (a count: no gradient); under cp this rank
    # holds s of the sequence's cp s tokens: the counts summed over the cp ranks
    counts = F.one_hot(experts.flatten(1), n_experts).sum(1).float()
    if cp is not None and cp.size > 1:
        cp.all_reduce(counts)
    f = counts / (s * k * (1 if cp is None else cp.size))
    return n_experts * (f * probs.mean(1)).sum(-1)  # (b,): P_e = the mean probability per sequence
