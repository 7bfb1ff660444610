"""The loss of a tensor-parallel model: cross-entropy over logits split by vocabulary rows
(Megatron's vocab_parallel_cross_entropy), without any rank holding the full (n, V) logits.

Idea: each tp rank holds logits (n, V/t) of its vocabulary rows. softmax needs each row's max and
sum of exp over all V, and the loss the target's logit, which lives on one rank: all-reduce the max
(n floats), then the sum of exp and the target logit together (2n floats). Backward is local:
(softmax - onehot) / count on this rank's columns. tp.py installs it as the head's `loss` entry
(seams.py).
Formula: bytes on the wire per step, ring over t ranks: 2(t-1)/t * 3n * 4 -- against (t-1)/t * n V *
B to gather the logits, so a 128k vocabulary's logits never cross the wire.
Lesson: lessons/05-tensor-parallel.md
"""

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    # logits (n, V/t) this rank's slice; targets (n,) ids
    def forward(ctx, logits, targets, tp, vocab_size):
        dtype, logits = logits.dtype, logits.float()
        v = logits.shape[-1]
        # padded rows: out of the softmax
        if vocab_size is not None and (tp.rank + 1) * v > vocab_size:
            # (V/t,) global ids
            ids = torch.arange(tp.rank * v, (tp.rank + 1) * v, device=logits.device)
            # a rank of only padding: max -inf
            logits = logits.masked_fill(ids >= vocab_size, float("-inf"))

        shifted = logits - tp.all_reduce(logits.max(dim=-1).values, op=dist.ReduceOp.MAX)[:, None]
        local = targets - tp.rank * v
        mine = (local >= 0) & (local < v)  # an ignored target (-1) is never mine
        local = local.masked_fill(~mine, 0)
        exp = shifted.exp()
        target_logit = shifted.gather(1, local[:, None])[:, 0].masked_fill(~mine, 0.0)

        # (2, n): one all-reduce for both
        stats = tp.all_reduce(torch.stack([exp.sum(-1), target_logit]))
        valid = targets != -1
        count = valid.sum()
        loss = (stats[0].log() - stats[1]).masked_fill(~valid, 0.0).sum() / count

        # exp -> softmax
        ctx.save_for_backward(exp.div_(stats[0][:, None]), local, mine, valid, count)
        ctx.dtype = dtype
        return loss

    @staticmethod
    # d loss / d logit = (softmax - onehot(target)) / count, 0 on ignored rows
    def backward(ctx, grad):
        softmax, local, mine, valid, count = ctx.saved_tensors
        g = softmax.scatter_add(1, local[:, None], -mine.to(softmax.dtype)[:, None])
        return (g * (grad * valid / count)[:, None]).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits, targets, tp, vocab_size=None):
    """Mean cross-entropy (fp32, ignore_index=-1) of vocab-sharded logits (..., V/t). No rank holds
    the full logits: the row max, the sum of exp and the target logit are reduced over tp (2
    all-reduces of n floats (the max) and 2n floats). Ids >= vocab_size (the padding) are masked
    out, as model.cross_entropy does."""
    return _VocabParallelCrossEntropy.apply(
        logits.flatten(0, -2), targets.flatten(), tp, vocab_size
    )
