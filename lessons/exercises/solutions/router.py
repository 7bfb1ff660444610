"""Solution of the router exercise: nanomega/moe.py:route."""

from nanomega import moe


def route(logits, k, router="mixtral", bias=None, groups=(1, 1), scale=1.0):
    router = moe.rule(router)
    if router == "deepseek_v3":
        return moe.sigmoid_route(logits, k, bias, groups, scale)
    probs = logits.softmax(-1)  # (T, E)
    score = logits if router == "mixtral" else probs  # top-k of either: the same experts
    experts = (score if bias is None else score + bias.float()).topk(k, dim=-1).indices  # (T, k)
    if router == "mixtral":
        return logits.gather(-1, experts).softmax(-1), experts, probs
    weights = probs.gather(-1, experts)  # (T, k)
    if router == "softmax_topk_norm":
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts, probs
