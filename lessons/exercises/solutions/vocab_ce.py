"""Solution of exercise vocab-ce (lessons/exercises/vocab_ce.py): what nanomega/tp_loss.py does,
written out."""

import torch
import torch.distributed as dist


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, tp, vocab_size):  # logits (n, V/t); targets (n,)
        dtype, logits = logits.dtype, logits.float()
        v = logits.shape[-1]
        if vocab_size is not None:  # padding columns: out of the softmax
            ids = torch.arange(tp.rank * v, (tp.rank + 1) * v, device=logits.device)
            logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
        shifted = logits - tp.all_reduce(logits.max(dim=-1).values, op=dist.ReduceOp.MAX)[:, None]
        local = targets - tp.rank * v
        mine = (local >= 0) & (local < v)  # an ignored target (-1) is never mine
        local = local.masked_fill(~mine, 0)
        exp = shifted.exp()
        target_logit = shifted.gather(1, local[:, None])[:, 0].masked_fill(~mine, 0.0)
        stats = tp.all_reduce(torch.stack([exp.sum(-1), target_logit]))  # (2, n)
        valid = targets != -1
        count = valid.sum()
        loss = (stats[0].log() - stats[1]).masked_fill(~valid, 0.0).sum() / count
        ctx.save_for_backward(exp / stats[0][:, None], local, mine, valid, count)
        ctx.dtype = dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, valid, count = ctx.saved_tensors
        g = softmax.scatter_add(1, local[:, None], -mine.to(softmax.dtype)[:, None])
        return (g * (grad * valid / count)[:, None]).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits, targets, tp, vocab_size=None):
    """Mean cross-entropy (fp32, ignore_index=-1) of vocab-sharded logits (..., V/t)."""
    return VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), tp, vocab_size)
