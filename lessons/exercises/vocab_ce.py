"""Exercise vocab-ce (lesson 05): the cross-entropy of vocabulary-split logits, no rank holding all
of them.

Each tp rank holds logits (n, V/t): the columns [r V/t, (r+1) V/t) of the full (n, V). With m_j =
max_k z_jk,
    loss = mean over the rows j with a target (targets[j] != -1) of  log sum_k exp(z_jk - m_j) - (z_jt - m_j)
needs, per row, the max over ALL V columns, the sum of exp over all V and the target's logit z_jt,
which lives on exactly one rank. All-reduce the max (op=torch.distributed.ReduceOp.MAX), then the
sum of exp and the target logit (0 on the ranks that do not hold it) -- 3n floats on the wire, never
the (n, V) logits.
Backward is local: d loss / d z_jk = (softmax_jk - [k == t_j]) / count on this rank's columns, 0 on
ignored rows.
Details the tests check: compute in fp32 and return the gradient in the logits' dtype (bf16 too);
columns with a global id >= vocab_size are padding: leave them out of the softmax (set them to -inf
before the max). `tp` is a nanomega.dist.Axis: tp.rank, tp.size, tp.all_reduce(t, op=...) (in place,
returns t).

Replaces nanomega/tp_loss.py:vocab_parallel_cross_entropy in the tests.
Grade:  python lessons/check.py --exercise vocab-ce lessons/exercises/vocab_ce.py
"""

import torch


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    # logits (n, V/t) this rank's columns; targets (n,)
    def forward(ctx, logits, targets, tp, vocab_size):
        # 1. fp32; mask the padding columns (global id >= vocab_size) to -inf
        # 2. subtract the row max, all-reduced with op=dist.ReduceOp.MAX
        # 3. the target's local column (targets - tp.rank * V/t), and which rows' targets are on
        # this rank
        # 4. one all-reduce of torch.stack([sum of exp, target logit]): (2, n)
        # 5. the mean loss over valid rows; save the softmax (exp / sum) and what backward needs
        raise NotImplementedError("exercise vocab-ce: write the forward")

    @staticmethod
    def backward(ctx, grad):  # grad: d(final)/d(loss), a scalar
        # (softmax - onehot(target on this rank)) * grad / count, 0 on ignored rows, in the logits'
        # dtype; one gradient per forward input: (dlogits, None, None, None)
        raise NotImplementedError("exercise vocab-ce: write the backward")


def vocab_parallel_cross_entropy(logits, targets, tp, vocab_size=None):
    """Mean cross-entropy (fp32, ignore_index=-1) of vocab-sharded logits (..., V/t)."""
    return VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), tp, vocab_size)
