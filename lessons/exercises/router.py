"""Exercise router (lesson 16): the MoE router, the rule that sends each token to k of E experts.

route(logits, k, router="mixtral", bias=None, groups=(1, 1), scale=1.0): logits (T, E) fp32, one
row of expert scores per token. Return (weights (T, k), experts (T, k), probs (T, E)): the k
experts each token goes to, the weight its output gets from each, and the affinities the balance
loss averages (every rule but deepseek_v3: the softmax over all E). The rules (nanomega/moe.py's
ROUTERS, each checked against its models' Hugging Face code):
    mixtral            choose the top-k of the logits; weights: the softmax over those k only
    softmax_topk       probabilities over all E; choose their top-k; weights: those probabilities,
                       NOT renormalized (a token's weights sum to less than 1)
    softmax_topk_norm  the same k experts; weights renormalized to sum to 1 over the k
    deepseek_v3        sigmoid scores, group limit, routed scaling: return
                       nanomega.moe.sigmoid_route(logits, k, bias, groups, scale) (given)
bias (E,) or None: added to the scores used to CHOOSE (DeepSeek-V3's balancing bias), never to a
weight. Old names: map `router` through nanomega.moe.rule first ("deepseek" and "qwen" computed
softmax_topk_norm and softmax_topk). Which two of the rules are one rule in two orders, and why?

Replaces nanomega/moe.py:route in the tests (tests/test_routers.py: each rule against transformers'
router of the models it is named for, and no other; the group limit; the old names).
Grade:  python lessons/check.py --exercise router lessons/exercises/router.py
"""

from nanomega import moe  # noqa: F401  (moe.rule, moe.sigmoid_route)


def route(logits, k, router="mixtral", bias=None, groups=(1, 1), scale=1.0):
    raise NotImplementedError("exercise router: write the routing rules")
