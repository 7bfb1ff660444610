"""Solution of exercise tp-fg (lessons/exercises/tp_fg.py): what nanomega/tp.py does, written
out."""

import torch


def _all_reduce(x, tp):
    return tp.all_reduce(x.clone(memory_format=torch.contiguous_format))  # a copy: autograd keeps x


class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward; backward sums the ranks' input gradients."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: forward sums the partial products over tp; backward is the identity."""

    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
