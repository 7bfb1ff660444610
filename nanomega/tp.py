"""Tensor parallelism (Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022).

Idea: split Y = XA by the columns of A (Y_i = X A_i, no communication) and the next matmul Z = YB by
the rows of B (Z = sum_i Y_i B_i: one all-reduce). Attention (qkv by heads, then the output
projection by rows) and the MLP (c_fc or gate/up by columns, c_proj by rows) are such pairs,
bracketed by the conjugate operators f (identity forward, all-reduce backward) and g (all-reduce
forward, identity backward). With t > n_kv (GQA) each rank holds the small k/v weight whole
(GroupKeyValue). Sequence parallelism also splits what lies between the pairs along the sequence: g
becomes a reduce-scatter, f an all-gather. The local matmuls are the op table's `linear` entry
(seams.py); the communication stays here. The sequence-parallel linear hands its weight-gradient
GEMM to wgrad.defer, so a zero-bubble schedule's W computes it (wgrad.py).
Formulas, per layer and rank, B = b s h bytes, ring over t ranks (derived in the lessons):
    TP  forward 2 all-reduces = 2 * 2(t-1)/t * B    backward the same
    SP  forward 2 x (all-gather + reduce-scatter): the same bytes
        backward the same + 2 all-gathers (t-1)/t * B (re-gathering the stored shards)
    activations  TP s b h (10 + 24/t + 5as/(ht))     SP s b h (34/t + 5as/(ht))
Lessons: lessons/05-tensor-parallel.md, lessons/06-sequence-parallel.md
"""

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanomega import seams, wgrad
from nanomega.rng import TrackedDropout
from nanomega.seams import Ops
from nanomega.tp_loss import vocab_parallel_cross_entropy


# ---------------------------------------------------------------- collectives as functions of
# tensors
def _all_reduce(x, tp):
    # never in place on autograd's grads
    return tp.all_reduce(x.clone(memory_format=torch.contiguous_format))


def _all_reduce_fp32(grad, tp):
    """SP: a replicated parameter's gradient summed over tp in fp32, whatever the model dtype (a
    16-bit sum of t partial gradients would round at every add; Megatron sums them in its fp32
    main_grad). None: a zero-bubble schedule deferred this weight's gradient (wgrad.py); the hook
    fires again when its W pass brings it."""
    if grad is None:
        return None
    return _all_reduce(grad.float(), tp).to(grad.dtype)


def _gather_seq(x, tp):  # (b, s/t, ...) -> (b, s, ...)
    out = x.new_empty((tp.size * x.shape[0],) + x.shape[1:])  # (t*b, s/t, ...): rank-major
    tp.all_gather(out, x.contiguous())
    # (b, t, s/t, ...) -> one copy
    return out.unflatten(0, (tp.size, -1)).transpose(0, 1).flatten(1, 2)


def _reduce_scatter_seq(x, tp):  # (b, s, ...) partial sums -> (b, s/t, ...) summed over tp
    b, s = x.shape[:2]
    if s % tp.size:
        raise ValueError(
            f"--sequence-parallel needs the sequence length {s} divisible by --tp {tp.size}; "
            f"use a block size that is a multiple of {tp.size}"
        )
    # (t, b, s/t, ...): one copy
    chunks = x.unflatten(1, (tp.size, s // tp.size)).transpose(0, 1).contiguous()
    return tp.reduce_scatter(x.new_empty((b, s // tp.size) + x.shape[2:]), chunks.flatten(0, 1))


class CopyToTensorParallel(torch.autograd.Function):
    """f: the input of a column-parallel layer. Identity forward; backward sums the ranks' input
    gradients."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: the output of a row-parallel layer. Forward sums the partial products; backward is the
    identity."""

    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """g under SP: forward reduce-scatters partial sums along the sequence; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, tp):  # (b, s, h) partial -> (b, s/t, h)
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):  # (b, s/t, h) -> (b, s, h)
        return _gather_seq(grad, ctx.tp), None


class LinearWithSequenceGather(torch.autograd.Function):
    """f under SP, fused with the column-parallel matmul: all-gather the sequence forward,
    reduce-scatter the input gradient backward. Only the 1/t input shard is stored; backward
    all-gathers it again for the weight gradient (Korthikanti et al. sec. 4.2.2; Megatron overlaps
    that gather, we do not). Its three matmuls are the table's linear (forward x W^T; backward dY W
    and dY^T X: seams.dgrad, seams.wgrad)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp, linear):  # x (b, s/t, h) -> (b, s, out/t)
        wgrad.save(ctx, x, weight)  # W's gradient to the parameter, under recompute too
        ctx.tp, ctx.has_bias, ctx.linear = tp, bias is not None, linear
        return linear(_gather_seq(x, tp), weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad (b, s, out/t)
        x, weight = wgrad.saved(ctx)
        linear = ctx.linear
        grad_x = (
            _reduce_scatter_seq(seams.dgrad(linear, grad, weight), ctx.tp)
            if ctx.needs_input_grad[0]
            else None
        )
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            total = _gather_seq(x, ctx.tp)  # (b, s, h): the price of storing only the shard
            # (out/t, h), now or at a zero-bubble schedule's W (wgrad.py)
            grad_w = wgrad.defer(weight, lambda: seams.wgrad(linear, grad, total, weight))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.flatten(0, -2).sum(0)
        return grad_x, grad_w, grad_b, None, None


def _reduce_output(x, tp, sequence_parallel):
    """Sum a row-parallel layer's partial outputs: all-reduce, or reduce-scatter along the sequence
    (SP)."""
    return (
        ReduceScatterToSequenceParallel if sequence_parallel else ReduceFromTensorParallel
    ).apply(x, tp)


# ---------------------------------------------------------------- layers
class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i: this rank's output features (rows of the torch weight); the output stays split
    over tp. ops: the block's table (seams.Ops), whose linear does the local matmul."""

    def __init__(self, weight, bias, tp, sequence_parallel=False, *, ops=None):
        super().__init__()
        self.weight = weight  # (out/t, in)
        self.register_parameter("bias", bias)  # (out/t,) or None
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.ops = ops or Ops(linear=F.linear)  # a table's, or standalone: F.linear

    def forward(self, x):  # (b, s, in), or (b, s/t, in) under SP -> (b, s, out/t)
        if self.sequence_parallel:
            return LinearWithSequenceGather.apply(
                x, self.weight, self.bias, self.tp, self.ops.linear
            )
        return self.ops.linear(CopyToTensorParallel.apply(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = sum_i Y_i B_i: this rank's input features (columns of the torch weight); the partial
    products are summed over tp, then the replicated bias is added once."""

    def __init__(self, weight, bias, tp, sequence_parallel=False, *, ops=None):
        super().__init__()
        self.weight = weight  # (out, in/t)
        self.register_parameter("bias", bias)  # (out,) replicated
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.ops = ops or Ops(linear=F.linear)  # a table's, or standalone: F.linear

    def forward(self, y):  # (b, s, in/t) -> (b, s, out), or (b, s/t, out) under SP
        z = _reduce_output(self.ops.linear(y, self.weight), self.tp, self.sequence_parallel)
        return z if self.bias is None else z + self.bias


class GroupKeyValue(nn.Module):
    """k, v of the one group this rank's query heads read (t > n_kv), from the whole (2 n_kv hd, h)
    weight (group None: all of it, MLA's latent projections); its gradient, this rank's heads'
    share, is summed over tp by apply_tensor_parallel's hook."""

    def __init__(self, weight, group, n_kv, tp, sequence_parallel=False, *, ops=None, bias=None):
        super().__init__()
        self.weight = weight  # (2 * n_kv * hd, h), replicated
        self.register_parameter("bias", bias)  # (2 * n_kv * hd,) replicated, or None
        self.group, self.n_kv, self.tp, self.sequence_parallel = group, n_kv, tp, sequence_parallel
        self.ops = ops or Ops(linear=F.linear)

    def forward(
        self, x
    ):  # (b, s, h), or (b, s/t, h) under SP -> (b, s, 2 hd): this group's k and v
        w, b = self.weight, self.bias  # group None: the whole weight (MLA's latent projections)
        if self.group is not None:  # this group's rows of k and of v: (2 hd, h)
            w = w.unflatten(0, (2, self.n_kv, -1))[:, self.group].flatten(0, 1)
            b = None if b is None else b.view(2, self.n_kv, -1)[:, self.group].flatten()
        if self.sequence_parallel:
            return LinearWithSequenceGather.apply(x, w, b, self.tp, self.ops.linear)
        return self.ops.linear(CopyToTensorParallel.apply(x, self.tp), w, b)


class VocabParallelEmbedding(nn.Module):
    """Rows [r V/t, (r+1) V/t) of the token embedding. A token held elsewhere looks up zeros; the
    sum over tp (all-reduce, or reduce-scatter along the sequence under SP) gives every rank its
    embeddings."""

    def __init__(self, weight, tp, sequence_parallel=False):
        super().__init__()
        self.weight = weight  # (V/t, h), the same Parameter as the vocab-parallel LM head (tied)
        self.tp, self.sequence_parallel = tp, sequence_parallel

    def forward(self, idx):  # (b, s) -> (b, s, h), or (b, s/t, h) under SP
        local = idx - self.tp.rank * self.weight.shape[0]
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(
            outside[..., None], 0.0
        )
        return _reduce_output(x, self.tp, self.sequence_parallel)


class SequenceParallelPositions(nn.Module):
    """The learned position embedding under SP: given all s positions, return this rank's s/t
    rows."""

    def __init__(self, weight, tp):
        super().__init__()
        self.weight, self.tp = weight, tp  # (block_size, h), replicated

    def forward(self, pos):  # (s,) -> (s/t, h)
        return F.embedding(pos.unflatten(0, (self.tp.size, -1))[self.tp.rank], self.weight)


# ---------------------------------------------------------------- sharding rules and the model
# transform parameter-name suffix -> (sharded dim, interleaved groups): c_attn's output is laid out
# (3, n_head, head_dim), so a rank takes its heads from each of q, k and v. Every other parameter is
# replicated across tp.
# Llama: kv_proj is laid out (2, n_kv, head_dim) and gate_up (2, f), so each splits as 2 interleaved
# groups.
_SPLIT = {
    "wte.weight": (0, 1),
    "lm_head.weight": (0, 1),
    "c_attn.weight": (0, 3),
    "c_attn.bias": (0, 3),
    "c_fc.weight": (0, 1),
    "fc_bias": (0, 1),
    "c_proj.weight": (1, 1),
    "q_proj.weight": (0, 1),
    "q_proj.bias": (0, 1),
    "kv_proj.weight": (0, 2),
    "kv_proj.bias": (0, 2),
    "gate_up.weight": (0, 2),
    "q_b_proj.weight": (0, 1),  # MLA (mla.py): the up-projections, laid out by heads
    "kv_b_proj.weight": (0, 1),
}
KV = "kv_proj.weight"
KV_BIAS = "kv_proj.bias"  # Qwen2's: split (or replicated) with its weight


def kv_replicated(cfg, tp_size):
    """Whether tp cannot split the key/value heads (n_kv not divisible by t): kv_proj is then held
    whole."""
    return cfg.arch == "llama" and cfg.kv_heads % tp_size != 0


def shard_rule(name, replicate_kv=False):
    """(sharded dim, interleaved groups) of the GPT parameter `name` across tp, or None: replicated.
    replicate_kv: kv_replicated(cfg, tp) for the layout in question (kv_proj is then replicated)."""
    rule = next(
        (rule for suffix, rule in _SPLIT.items() if name == suffix or name.endswith("." + suffix)),
        None,
    )
    return None if replicate_kv and name.endswith((KV, KV_BIAS)) else rule


def shard_param(name, full, tp_rank, tp_size, replicate_kv=False):
    """This tp rank's slice (a view) of the full GPT parameter `name`; replicated parameters come
    back whole."""
    rule = shard_rule(name, replicate_kv)
    if rule is None:
        return full
    dim, groups = rule
    return full.unflatten(dim, (groups, tp_size, -1)).select(dim + 1, tp_rank).flatten(dim, dim + 1)


def unshard_param(name, shards, replicate_kv=False):
    """The full parameter from the tp ranks' slices, in rank order (inverse of shard_param)."""
    rule = shard_rule(name, replicate_kv)
    if rule is None:
        return shards[0]
    dim, groups = rule
    full = torch.cat([s.unflatten(dim, (groups, -1)) for s in shards], dim + 1)
    return full.flatten(dim, dim + 1)


def _shard(p, name, tp):
    q = nn.Parameter(
        shard_param(name, p.detach(), tp.rank, tp.size).clone(), requires_grad=p.requires_grad
    )
    q.tensor_parallel = True  # read through is_tensor_parallel
    return q


def is_tensor_parallel(p):
    """Whether p is this tp rank's slice (not a replica): zero.py's gradient norm counts a slice on
    every tp rank, a replicated parameter on one; sequence parallelism all-reduces the replicas'
    gradients."""
    return getattr(p, "tensor_parallel", False)


def check_tensor_parallel(cfg, tp_size, sequence_parallel=False):
    """One-line errors for shapes tp cannot split (raised before any collective)."""
    sizes = [("--n-head", cfg.n_head), ("--n-embd", cfg.n_embd)]
    sizes += [("--ffn-hidden", cfg.ffn)] * (cfg.arch == "llama")
    common = math.gcd(*(n for _, n in sizes))
    choices = ", ".join(str(d) for d in range(1, cfg.n_head + 1) if common % d == 0)

    for flag, n in sizes:
        if n % tp_size:
            raise ValueError(
                f"--tp {tp_size} does not divide {flag} {n}; choose --tp among {choices}"
            )

    if kv_replicated(cfg, tp_size) and tp_size % cfg.kv_heads:
        raise ValueError(
            f"--tp {tp_size} and --n-kv-head {cfg.kv_heads}: one must divide the other (tp splits "
            f"the key/value heads, or replicates each on tp / n_kv ranks)"
        )
    if cfg.padded_vocab_size % tp_size:
        raise ValueError(
            f"padded vocab size {cfg.padded_vocab_size} is not divisible by --tp {tp_size}; set "
            f"make_vocab_size_divisible_by = 128 * tp (train.py does)"
        )
    if sequence_parallel and cfg.block_size % tp_size:
        raise ValueError(
            f"--sequence-parallel needs --block-size {cfg.block_size} divisible by --tp {tp_size}"
        )


def apply_tensor_parallel(model, tp, sequence_parallel=False, rng=None):
    """Replace, in place, the pieces of a dense GPT by parallel ones holding this rank's slice of
    the same weights (so a TP model built from seed S is the dense one from seed S, sliced). Called
    unchanged after: model(idx, targets) -> loss; with targets=None it returns this rank's vocab
    slice of the logits. Under SP every replicated parameter sees 1/t of the tokens: a hook
    all-reduces its gradient over tp as it is computed (per backward, before accumulation into
    .grad), so no trainer call can be forgotten. rng: the rng.RNGTracker from
    rng.model_parallel_seed, required when cfg.dropout > 0."""
    cfg, sp = model.cfg, sequence_parallel
    check_tensor_parallel(cfg, tp.size, sp)
    if cfg.dropout > 0 and rng is None:
        raise ValueError(
            "dropout > 0 under tensor parallelism needs rng=rng.model_parallel_seed(seed, grid)"
        )
    drop = functools.partial(TrackedDropout, cfg.dropout, rng)  # for sharded activations
    emb = model.embed
    wte = _shard(emb.wte.weight, "wte.weight", tp)
    emb.wte = VocabParallelEmbedding(wte, tp, sp)
    if sp and emb.wpe is not None:
        emb.wpe = SequenceParallelPositions(emb.wpe.weight, tp)
    # replicated parameters whose gradient is a partial sum on each rank (GroupKeyValue)
    summed = []

    def column(weight, name, bias=None):  # this rank's output features of a dense (out, in) weight
        return ColumnParallelLinear(_shard(weight, name, tp), bias, tp, sp, ops=ops)

    def column_of(linear, name):  # the same, its bias (if any) split with it (Qwen2's q, k, v)
        bias = (
            None
            if linear.bias is None
            else _shard(linear.bias, name[: -len("weight")] + "bias", tp)
        )
        return column(linear.weight, name, bias)

    def row(linear):  # this rank's input features of a dense c_proj; its bias stays replicated
        return RowParallelLinear(
            _shard(linear.weight, "c_proj.weight", tp), linear.bias, tp, sp, ops=ops
        )

    # the trunk's blocks and the MTP modules' (mtp.py), split alike
    mtp_blocks = [depth.block for depth in model.mtp.depths.values()] if model.mtp else []
    for block in [*model.blocks.values(), *mtp_blocks]:
        attn, mlp, ops = block.attn, block.mlp, block.ops
        if hasattr(attn, "c_attn"):  # GPT-2: (3, n_head, hd), by heads
            attn.c_attn = column(
                attn.c_attn.weight, "c_attn.weight", _shard(attn.c_attn.bias, "c_attn.bias", tp)
            )
        # MLA: the latents' projections whole on every rank (gradients summed), heads split after
        elif hasattr(attn, "kv_b_proj"):
            for name in ("q_a_proj", "kv_a_proj"):
                if hasattr(attn, name):
                    summed.append(getattr(attn, name).weight)
                    setattr(attn, name, GroupKeyValue(summed[-1], None, 1, tp, sp, ops=ops))
            for name in ("q_b_proj", "kv_b_proj"):  # their input, the latent, is on every rank
                if hasattr(attn, name):
                    up = getattr(attn, name)
                    up.weight = _shard(up.weight, name + ".weight", tp)
            if hasattr(attn, "q_proj"):
                attn.q_proj = column_of(attn.q_proj, "q_proj.weight")
            summed += [
                getattr(attn, n).weight for n in ("q_a_norm", "kv_a_norm") if hasattr(attn, n)
            ]
        # Llama: q by heads; k/v by key/value heads, or the one group of this rank's heads (t >
        # n_kv)
        else:
            attn.q_proj = column_of(attn.q_proj, "q_proj.weight")
            if kv_replicated(cfg, tp.size):
                group = tp.rank * attn.n_head // tp.size // (attn.n_head // attn.n_kv_head)
                kv = attn.kv_proj
                attn.kv_proj = GroupKeyValue(
                    kv.weight, group, attn.n_kv_head, tp, sp, ops=ops, bias=kv.bias
                )
                summed += [p for p in (kv.weight, kv.bias) if p is not None]
            else:
                attn.kv_proj = column_of(attn.kv_proj, KV)
            # Qwen3's QK-norm scales are replicated; each rank's heads give a part of their gradient
            summed += [n.weight for n in (attn.q_norm, attn.k_norm) if n is not None]
            attn.n_kv_head = max(1, attn.n_kv_head // tp.size)
        attn.c_proj = row(attn.c_proj)
        attn.n_head //= tp.size  # (b, s, 3h/t) viewed as (b, s, 3, n_head/t, head_dim)
        if attn.slopes is not None:
            # ALiBi: this rank's heads' slopes
            attn.slopes = attn.slopes.chunk(tp.size)[tp.rank].clone()
        # MoE: each expert split as one MLP
        for m in mlp.swiglus() if hasattr(mlp, "swiglus") else [mlp]:
            if hasattr(m, "c_fc"):
                m.c_fc, m.fc_bias = (
                    column(m.c_fc.weight, "c_fc.weight"),
                    _shard(m.fc_bias, "fc_bias", tp),
                )
            else:  # Llama: [gate; up], each half split by columns
                m.gate_up = column(m.gate_up.weight, "gate_up.weight")
            m.c_proj = row(m.c_proj)
        if cfg.dropout > 0:
            attn.attn_drop = drop()  # heads differ per rank
            if sp:  # the residual stream is split along the sequence, so its masks must differ too
                attn.resid_drop, mlp.drop = drop(), drop()
    if sp and cfg.dropout > 0:
        emb.drop = drop()
    ops = model.head.ops  # tied: the same (V/t, h) Parameter as the embedding
    lm_head = wte if cfg.tie_embeddings else _shard(model.head.lm_head.weight, "lm_head.weight", tp)
    model.head.lm_head = ColumnParallelLinear(lm_head, None, tp, sp, ops=ops)
    model.replace_op(
        "loss", functools.partial(vocab_parallel_cross_entropy, tp=tp, vocab_size=cfg.vocab_size)
    )
    if sp:  # every replicated parameter saw 1/t of the tokens (GroupKeyValue's weight among them)
        summed = [p for p in model.parameters() if not is_tensor_parallel(p)]
    for p in summed:
        if p.requires_grad:
            p.register_hook(functools.partial(_all_reduce_fp32, tp=tp))
    return model
