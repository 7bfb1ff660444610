"""The backward split in two: B, the input gradient now; W, the weight gradients later.

Idea (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 2): a linear's backward is two
GEMMs, dX = dY W (the previous stage waits for it: the critical path) and dW = dY^T X (only the
optimizer waits for it). `linear`, the op table's entry under a zero-bubble schedule, computes dX
in B and, while a `deferring()` block is open, stashes what dW needs (X and dY) instead of computing
it; `flush` (the schedule's W) computes the stashed dW later and accumulates them through autograd,
so each parameter's post-accumulate-grad hooks (ddp.py and zero_buckets.py reduce there) fire when
its last W has run. Outside a deferring block the entry computes dW at once, with the same GEMMs as
F.linear's autograd (tests/test_zero_bubble.py: bitwise). tp.py's sequence-parallel linear defers
its dW through `defer` the same way.
Formulas (a linear of n tokens, in -> out features):
    F = B = W = 2 n in out FLOPs         (t_f ~ t_b ~ t_w: the paper's T_F = T_B = T_W)
    held from B to W: X (n x in) and dY (n x out), the inputs of the dW GEMM
Lesson: lessons/08-pipeline-parallel.md
"""

import contextlib

import torch
import torch.nn.functional as F

STASHES = []  # open deferring() blocks, innermost last; the backward's thread reads it


@contextlib.contextmanager
def deferring():
    """Inside: every weight gradient `defer` is handed goes into the yielded stash, [(weight,
    compute)]."""
    stash = []
    STASHES.append(stash)
    try:
        yield stash
    finally:
        STASHES.pop()


def defer(weight, compute):
    """compute() -> weight's gradient: stashed (returns None) inside a deferring block, else run."""
    if STASHES:
        STASHES[-1].append((weight, compute))
        return None
    return compute()


def save(ctx, x, weight):
    """ctx.save_for_backward(x, weight), and a leaf weight (a parameter) kept as itself: under full
    recompute (torch.utils.checkpoint) backward unpacks the rerun's tensors, and a saved leaf comes
    back as a new tensor that reaches the parameter only through a weak reference to its gradient
    accumulator; W runs after B freed the graph that held it, so W's gradient went to the copy."""
    ctx.save_for_backward(x, weight)
    ctx.weight = weight if weight.is_leaf else None  # a non-leaf one reaches it through its graph


def saved(ctx):
    """(x, weight) as `save` kept them: the parameter itself, for `defer`."""
    x, weight = ctx.saved_tensors
    return x, weight if ctx.weight is None else ctx.weight


def flush(stash):
    """W: compute every stashed weight gradient, then accumulate them as autograd does (one
    backward from the weights, so p.grad and the gradient hooks see what B would have done)."""
    if not stash:
        return
    with torch.no_grad():
        grads = [compute() for _, compute in stash]
    torch.autograd.backward([w for w, _ in stash], grads)
    stash.clear()


class SplitLinear(torch.autograd.Function):
    """x W^T + b whose backward computes dX and db, and hands the dW GEMM to `defer`."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        save(ctx, x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad (..., out)
        x, weight = saved(ctx)
        g = grad.reshape(-1, grad.shape[-1])  # (n, out)
        grad_x = grad_w = grad_b = None
        # the GEMMs of F.linear's autograd (addmm's backward): dX = dY W, dW = dY^T X
        if ctx.needs_input_grad[0]:
            grad_x = g.mm(weight).view(x.shape)  # (..., in)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])  # (n, in)
            grad_w = defer(weight, lambda: g.t().mm(x2))  # (out, in), now or at W
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)  # (out,)
        return grad_x, grad_w, grad_b


def linear(x, weight, bias=None):
    """The `linear` entry of a zero-bubble model (seams.Ops): F.linear, its dW deferrable."""
    if not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return SplitLinear.apply(x, weight, bias)


def split_backward(model):
    """Make every linear of the model (tp.py's included: they call the entry) split its backward."""
    model.replace_op("linear", linear)
    return model


def is_split(model):
    """Whether every table's linear entry is `linear` (a zero-bubble schedule needs it)."""
    return all(ops.linear is linear for ops in model.op_tables().values() if ops.linear)
