"""Gradient clipping by the global norm of a model sharded over dp, tp and pp (Megatron's).

clip_grad_norm_ scales every gradient by min(1, c / ||g||), ||g|| the whole model's norm (Megatron's
clip_grads). No rank holds it: each sums the squares of its share of the pieces, every unique
element once, and one all-reduce per axis adds the shares; in fp64, chunk by chunk, so the order
does not matter and every layout computes the dense model's norm (tests/test_layouts.py: bitwise).
    counted here   a tp slice on every tp rank; a tp replica (LayerNorm, row-parallel bias) on tp
                   rank 0 only; a dp replica on dp rank 0 only when the pieces differ per dp rank
                   (ZeRO-1..3's shards); a copy its replica group marks uncounted never (the
                   last pipeline stage's tied embedding: zero_rules.Replicas, pp.tied_rule)
    ||g||^2        = all_reduce_dp(if sharded) o all_reduce_tp o all_reduce_pp ( sum ||piece||^2 )
Lesson: lessons/04-data-parallel-and-zero.md
"""

import torch

from . import tp

# elements per fp64 chunk of the norm (a whole fp64 copy would cost 2x the gradient)
NORM_CHUNK = 2**20


def fp64_norms(grads):
    """The 2-norms of the gradients' chunks of NORM_CHUNK elements, each summed in fp64 (the cast
    copies a chunk: a whole fp64 copy of a large gradient would cost twice its memory). One
    multi-tensor call: on CUDA a few kernel launches for the whole model instead of one per
    parameter (~150 for a GPT-2); on the CPU torch runs the same per-tensor vector_norm, so the
    values are those of a loop (tests/test_zero.py holds them bitwise)."""
    chunks = [
        c
        for t in grads
        for c in (t.reshape(-1).split(NORM_CHUNK) if t.numel() > NORM_CHUNK else (t,))
    ]
    return list(torch._foreach_norm(chunks, 2, dtype=torch.float64)) if chunks else []


def counts(p, replica, grid, over_dp):
    """Whether this rank's piece of parameter p is its share of the global norm (the table above).
    replica: every dp rank holds this same piece; over_dp: the pieces differ per dp rank
    (ZeRO-1..3)."""
    return (grid.tp_rank == 0 or tp.is_tensor_parallel(p)) and not (
        replica and over_dp and grid.dp_cp.rank
    )


def global_norm(shares, grid, over_dp, device):
    """sqrt(sum g^2) over the shares (global_norm_squared's): a float (one host sync)."""
    return global_norm_squared(shares, grid, over_dp, device).sqrt().item()


def global_norm_squared(shares, grid, over_dp, device, pp=True):
    """The same sum of squares, left on the device (fp64, one element): a trainer reads it together
    with the loss, in the step's one host sync before the update (train.train_step).
    shares: per replica group (zero_rules.Replicas), (grads, axis, across): this rank's counted shares;
    the group's replicas, summed over when over_dp; None, or the ranks holding its other parameters
    (ep's experts), summed over too. pp=False: this stage's sum (post_validate.py adds the stages')."""
    sq = None
    for grads, axis, across in shares:
        part = square_sum(grads, device)
        if over_dp:
            axis.all_reduce(part)  # the dense weights: dp_cp (dp's Axis when cp = 1); experts: edp
        if across is not None:
            part = across.all_reduce(part)
        sq = part if sq is None else sq.add_(part)
    grid.tp.all_reduce(sq)
    if pp:
        grid.pp.all_reduce(sq)
    return sq


def square_sum(grads, device):
    """sum g^2 over the tensors, in fp64 (1-element tensor)."""
    norms = fp64_norms(grads)
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    return sq + torch.stack(norms).square().sum() if norms else sq


def coefficient(norm, max_norm):
    """The factor clip_ scales by: max_norm / (norm + 1e-6) when that is below 1 (torch's rule),
    else 1."""
    return (
        max_norm / (norm + 1e-6) if max_norm is not None and max_norm / (norm + 1e-6) < 1.0 else 1.0
    )


def clip_(grads, norm, max_norm):
    """Scale the gradients in place by coefficient(norm, max_norm) when that is below 1."""
    if coefficient(norm, max_norm) < 1.0:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
