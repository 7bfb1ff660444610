"""Exercise balance (lesson 16): the MoE balance loss that keeps a router from sending every token
to a few experts.

balance_loss(probs, experts, n_experts, cp=None): probs (b, s, E), each token's router probabilities over
all E experts (what moe.route returns as its third value); experts (b, s, k), the k experts each
token was sent to. Return a (b,) tensor: the Switch/GShard loss of lesson 16's Formula (DeepSeek-V3's
sequence-wise loss is the same expression on its normalized sigmoid scores), one value per
sequence. The invariants to build it from:
    - it is 1 when the probabilities and the assignments are spread evenly over the E experts, and
      E when one expert gets every assignment and all the probability;
    - its statistics are taken per SEQUENCE, never over the batch or the micro-batch: the sequence
      is the unit no layout splits (dp, gradient accumulation, ep), so no layout changes the loss;
    - an expert's share of the assignments counts all k choices of every token (the shares sum to
      1); a count has no gradient, so the loss reaches the router through the probabilities only;
    - cp (a dist.Axis, or None): under context parallelism this rank holds only s of each
      sequence's cp s tokens; the shares must still be the whole sequence's (cp.all_reduce sums a
      tensor over the cp ranks), while the mean probabilities stay this rank's own (lesson 16).

Replaces nanomega/moe.py:balance_loss in the tests (tests/test_balance_loss.py: the definition
written out per sequence, the two extremes, the gradient; tests/test_hf_deepseek.py: DeepSeek-V3's
sequence-wise loss from its paper; tests/test_routers.py: transformers' Mixtral loss).
Grade:  python lessons/check.py --exercise balance lessons/exercises/balance.py
"""

import torch  # noqa: F401  (you will need it)
import torch.nn.functional as F  # noqa: F401  (F.one_hot counts assignments)


def balance_loss(probs, experts, n_experts, cp=None):
    raise NotImplementedError("exercise balance: write the per-sequence balance loss")
