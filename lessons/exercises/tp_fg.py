"""Exercise tp-fg (lesson 05): Megatron's conjugate operators f and g, as two autograd Functions.

A column-parallel linear Y_i = X A_i starts with f; a row-parallel linear Z = sum_i Y_i B_i ends
with g:
    f  forward: the identity (every tp rank already holds all of X)
       backward: dL/dX = sum over the ranks of X's gradient through A_i -- an all-reduce
    g  forward: Z = sum_i Y_i B_i -- an all-reduce of the partial products
       backward: the identity (Z's gradient is the same on every rank)
`tp` is a nanomega.dist.Axis: tp.all_reduce(t) sums t over the tp ranks IN PLACE and returns it.
Mind two things: never all-reduce a tensor autograd still owns (the forward's input, the incoming
gradient) in place -- clone it first; and backward returns one gradient per forward input (None for
`tp`).

Replaces nanomega/tp.py:CopyToTensorParallel and nanomega/tp.py:ReduceFromTensorParallel in the
tests.
Grade:  python lessons/check.py --exercise tp-fg lessons/exercises/tp_fg.py
"""

import torch


class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward; backward sums the ranks' input gradients."""

    @staticmethod
    def forward(ctx, x, tp):  # x (b, s, h): the same on every tp rank
        # keep what backward needs on ctx; return x unchanged
        raise NotImplementedError("exercise tp-fg: write f's forward")

    @staticmethod
    def backward(ctx, grad):  # grad (b, s, h): this rank's share of dL/dx
        # return (the sum of grad over the tp ranks, None)
        raise NotImplementedError("exercise tp-fg: write f's backward")


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: forward sums the partial products over tp; backward is the identity."""

    @staticmethod
    def forward(ctx, x, tp):  # x (b, s, h): this rank's partial sum
        # return the sum of x over the tp ranks (on a copy of x)
        raise NotImplementedError("exercise tp-fg: write g's forward")

    @staticmethod
    def backward(ctx, grad):
        # return (dL/dx, None): what is the derivative of a sum with respect to one of its terms?
        raise NotImplementedError("exercise tp-fg: write g's backward")
