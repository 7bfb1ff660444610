"""Context parallelism: the sequence split over a cp axis inside attention too (ring, all-gather,
Ulysses).

Idea: each rank holds s/cp tokens for the whole layer; only attention needs the other ranks' tokens:
    ring       (Liu et al. 2023) K/V pass rank to rank in cp - 1 p2p steps, each sent while the
               current block computes; blocks merge with the online softmax; backward recomputes
               each block from the saved lse while K/V, and their gradients, go round again
    allgather  (Llama 3) all-gather K/V once, attend locally; backward re-gathers them and
               reduce-scatters dK/dV
    ulysses    (Jacobs et al. 2023) all-to-all from sequence shards to head shards and back
               (cp <= n_kv / tp)
Causal load balancing: 2 cp chunks, rank c holds chunks c and 2cp-1-c (pairs_per_rank: the work).
The model meets cp through its op tables (seams.py): the `core` and `positions` entries.
Formulas (one home: formulas.py); bytes one rank sends per layer, B_kv = b s/cp n_kv hd bytes of K:
    online softmax  lse' = log(e^lse + e^l),  out' = out e^(lse - lse') + o e^(l - lse')
    ring       fwd (cp-1) 2 B_kv    bwd (cp-1) 2 B_kv (K/V again) + cp 2 B_kv (dK/dV in fp32)
    allgather  fwd (cp-1)/cp x cp 2 B_kv (wire)    bwd the same gather + a reduce-scatter of dK/dV
    ulysses    4 all-to-alls (q, k, v, out) of (cp-1)/cp of their bytes, forward and backward
Lesson: lessons/07-long-context.md
"""

import functools
import math

import torch
import torch.nn.functional as F

from .modern import document_mask

METHODS = ("ring", "allgather", "ulysses")
# attention work this process did (tests and the lesson reset and read it)
WORK = {"pairs": 0.0, "flops": 0}


# ---------------------------------------------------------------- which tokens a rank holds
def chunks_of(rank, cp, balanced=True):
    """The chunks rank holds, of 2 cp chunks (balanced: head c and tail 2cp-1-c) or of cp
    (contiguous)."""
    return (rank, 2 * cp - 1 - rank) if balanced else (rank,)


def positions(s, cp, rank, balanced=True):
    """(s/cp,) the positions of this rank's tokens in the sequence, in the order it holds them."""
    n = 2 * cp if balanced else cp
    if s % n:
        raise ValueError(
            f"--cp {cp} needs --block-size {s} divisible by {n} (2 x cp chunks, head and tail)"
        )
    return torch.cat(
        [torch.arange(c * s // n, (c + 1) * s // n) for c in chunks_of(rank, cp, balanced)]
    )


def local(x, cp, rank, dim=1):
    """This rank's tokens of a (b, s, ...) tensor (a batch, its targets): the chunks `positions`
    names."""
    return x.index_select(dim, positions(x.shape[dim], cp, rank).to(x.device))


def split(tensors, axis):
    """This cp rank's tokens of a batch's (b, s) tensors (ids, targets); the batch itself when cp =
    1."""
    return tensors if axis.size == 1 else tuple(local(t, axis.size, axis.rank) for t in tensors)


def pairs_per_rank(cp, balanced=True):
    """[causal (query chunk, key chunk) pairs of rank c, for c in cp]: a diagonal pair is half a
    full one."""
    return [
        sum(
            1.0 if k < q else 0.5 if k == q else 0.0
            for q in chunks_of(c, cp, balanced)
            for j in range(cp)
            for k in chunks_of(j, cp, balanced)
        )
        for c in range(cp)
    ]


# ---------------------------------------------------------------- one (query chunk, key chunk) pair
def _mask(qi, ki, c, docs_q, docs_k, device):
    """(c, c) or (b, 1, c, c) True where the query may see the key: causal between chunks qi and ki,
    and in one document when docs (b, c) ids are given. None: no mask (ki < qi, no documents)."""
    mask = None
    if ki == qi:
        mask = torch.ones(c, c, dtype=torch.bool, device=device).tril()
    if docs_q is not None:
        same = docs_q[:, None, :, None] == docs_k[:, None, None, :]  # (b, 1, c, c)
        mask = same if mask is None else same & mask
    return mask


# (b, nh, c, hd) x (b, nh, c, hd) -> (b, nh, c, c) fp32, masked -inf
def _scores(q, k, mask, scale):
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _expand(t, heads):  # grouped-query: (b, n_kv, c, hd) -> (b, nh, c, hd)
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t, kv_heads):  # the gradient of _expand: (b, nh, c, hd) summed back to (b, n_kv, c, hd)
    return t if t.shape[1] == kv_heads else t.unflatten(1, (kv_heads, -1)).sum(2)


def pair_forward(q, k, v, mask, scale):
    """softmax over this key chunk alone: (out (b, nh, c, hd) fp32, lse (b, nh, c) fp32, -inf where
    no key)."""
    s = _scores(q, _expand(k, q.shape[1]), mask, scale)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)  # a fully masked row: exp(-inf) = 0 everywhere, no NaN
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = (p @ _expand(v, q.shape[1]).float()) / total.clamp_min(1e-30)
    WORK["flops"] += 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
    return out, (m + total.log()).squeeze(-1)


def merge(acc, new):
    """The online softmax: two partial (out, lse) of the same query rows -> their softmax over both
    key sets."""
    if acc is None:
        return new
    (o1, l1), (o2, l2) = acc, new
    lse = torch.logaddexp(l1, l2)
    # a row no key reached yet (documents): weights 0, not NaN
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    return o1 * torch.exp(l1 - safe)[..., None] + o2 * torch.exp(l2 - safe)[..., None], lse


def pair_backward(q, k, v, out, dout, lse, delta, mask, scale):
    """Gradients of one pair from the saved lse (FlashAttention's backward): p = exp(s - lse) is the
    final softmax's slice; ds = p (dp - rowsum(dout out)). Returns dq, dk, dv (fp32, k/v folded to
    n_kv heads)."""
    heads = q.shape[1]
    ke, ve = _expand(k, heads).float(), _expand(v, heads).float()
    p = torch.exp(_scores(q, ke, mask, scale) - lse[..., None])  # (b, nh, c, c), 0 where masked
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ ve.transpose(-2, -1) - delta[..., None])
    dq, dk = (ds @ ke) * scale, (ds.transpose(-2, -1) @ q.float()) * scale
    return dq, _fold(dk, k.shape[1]), _fold(dv, v.shape[1])


class Layout:
    """The chunks of every rank of a cp axis, the chunk size, and the document ids (b, s) if any."""

    def __init__(self, cp, rank, s, docs=None, balanced=True):
        self.cp, self.rank, self.balanced, self.docs = cp, rank, balanced, docs
        self.c = s // (2 * cp if balanced else cp)

    def chunks(self, rank):
        return chunks_of(rank, self.cp, self.balanced)

    def doc(self, chunk):
        return None if self.docs is None else self.docs[:, chunk * self.c : (chunk + 1) * self.c]

    def pairs(self, src, device):
        """(query slot, key slot, mask) for this rank's queries against rank src's keys: only the
        pairs with work (a key chunk after a query chunk is skipped whole: the load balancing's
        saving)."""
        for a, qi in enumerate(self.chunks(self.rank)):
            for b, ki in enumerate(self.chunks(src)):
                if ki <= qi:
                    WORK["pairs"] += 1.0 if ki < qi else 0.5
                    yield a, b, _mask(qi, ki, self.c, self.doc(qi), self.doc(ki), device)


def _slot(t, i, c):  # slot i (a chunk) of a (..., s_local, hd) tensor
    return t[..., i * c : (i + 1) * c, :]


def attend(q, kv_from, layout, scale):
    """Forward over the key/value blocks kv_from yields as (src rank, (2, b, n_kv, s_local, hd)),
    own first: (out (b, nh, s_local, hd) fp32, lse (b, nh, s_local))."""
    c, acc = layout.c, {}
    for src, kv in kv_from:
        for a, b, mask in layout.pairs(src, q.device):
            acc[a] = merge(
                acc.get(a),
                pair_forward(_slot(q, a, c), _slot(kv[0], b, c), _slot(kv[1], b, c), mask, scale),
            )
    outs, lses = zip(*(acc[a] for a in sorted(acc)))
    return torch.cat(outs, -2), torch.cat(lses, -1)


def attend_backward(saved, kv, src, layout, scale, dq):
    """Adds this rank's queries' gradient through rank src's keys to dq; returns dkv (2, b, n_kv,
    s_local, hd)."""
    q, out, dout, lse, delta = saved
    c, dkv = layout.c, torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)

    for a, b, mask in layout.pairs(src, q.device):
        dqa, dk, dv = pair_backward(
            _slot(q, a, c),
            _slot(kv[0], b, c),
            _slot(kv[1], b, c),
            _slot(out, a, c),
            _slot(dout, a, c),
            lse[..., a * c : (a + 1) * c],
            delta[..., a * c : (a + 1) * c],
            mask,
            scale,
        )
        _slot(dq, a, c).add_(dqa)
        _slot(dkv[0], b, c).add_(dk)
        _slot(dkv[1], b, c).add_(dv)
    return dkv


def _saved(ctx, dout):
    q, k, v, out, lse = ctx.saved_tensors
    dout = dout.float()
    return q, k, v, (q, out, dout, lse, (dout * out).sum(-1))  # delta = rowsum(dout * out)


class RingAttention(torch.autograd.Function):
    """K/V passed around the cp ring (p2p, wait=False: the next block travels while this one
    computes)."""

    @staticmethod
    def forward(ctx, q, k, v, axis, layout, scale):
        n, r = axis.size, axis.rank

        def blocks():
            kv = torch.stack((k, v))  # (2, b, n_kv, s_local, hd): one message per step
            for t in range(n):
                nxt = torch.empty_like(kv) if t < n - 1 else None
                works = (
                    axis.p2p([(kv, (r + 1) % n)], [(nxt, (r - 1) % n)], wait=False)
                    if nxt is not None
                    else []
                )
                yield (r - t) % n, kv  # computed while the next block travels
                for work in works:
                    work.wait()
                kv = nxt

        out, lse = attend(q, blocks(), layout, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.axis, ctx.layout, ctx.scale = axis, layout, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, saved = _saved(ctx, dout)
        axis, n, r = ctx.axis, ctx.axis.size, ctx.axis.rank
        kv, dq, acc = (
            torch.stack((k, v)),
            torch.zeros(q.shape, dtype=torch.float32, device=q.device),
            None,
        )

        # K/V go round again (model dtype); their gradient (acc, fp32) one step behind them
        for t in range(n):
            # matched in order per peer
            sends = ([kv] if t < n - 1 else []) + ([acc] if acc is not None else [])
            # the previous rank sends the same kinds and shapes
            recvs = [torch.empty_like(m) for m in sends]
            works = (
                axis.p2p(
                    [(m, (r + 1) % n) for m in sends], [(m, (r - 1) % n) for m in recvs], wait=False
                )
                if n > 1
                else []
            )
            mine = attend_backward(saved, kv, (r - t) % n, ctx.layout, ctx.scale, dq)
            for work in works:
                work.wait()
            if t > 0:  # what the ranks before added for this block, from the message just received
                mine += recvs[-1]
            acc = mine
            if t < n - 1:
                kv = recvs[0]

        # after cp steps each block's gradient is complete one rank before home: one last hop
        if n > 1:
            home = torch.empty_like(acc)
            axis.p2p([(acc, (r + 1) % n)], [(home, (r - 1) % n)])
            acc = home
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None


class AllGatherAttention(torch.autograd.Function):
    """Llama 3's: all-gather K/V over cp, attend locally; backward re-gathers them and
    reduce-scatters dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, axis, layout, scale):
        kvs = _gather(axis, k, v)  # (cp, 2, b, n_kv, s_local, hd)
        n, r = axis.size, axis.rank
        # own first
        out, lse = attend(q, (((r - t) % n, kvs[(r - t) % n]) for t in range(n)), layout, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.axis, ctx.layout, ctx.scale = axis, layout, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, saved = _saved(ctx, dout)
        axis, kvs = ctx.axis, _gather(ctx.axis, k, v)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkvs = torch.stack(
            [attend_backward(saved, kvs[j], j, ctx.layout, ctx.scale, dq) for j in range(axis.size)]
        )
        # every rank's part of my keys, summed
        mine = axis.reduce_scatter(torch.empty_like(dkvs[:1]), dkvs)[0]
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None


def _gather(axis, k, v):
    kv = torch.stack((k, v))[None]  # (1, 2, b, n_kv, s_local, hd)
    return axis.all_gather(kv.new_empty((axis.size,) + kv.shape[1:]), kv)


# ---------------------------------------------------------------- Ulysses: sequence shards <-> head
# shards
def _seq_to_heads(x, axis, order):
    """(b, H, s_local, hd) sequence-sharded -> (b, H/cp, s, hd) head-sharded, the sequence in
    natural order."""
    b, heads, sl, hd = x.shape
    n = axis.size
    # (cp, b, H/cp, s_l, hd): group i -> rank i
    send = x.unflatten(1, (n, heads // n)).movedim(1, 0).contiguous()
    # (cp, b, H/cp, s_l, hd): rank j's tokens of my heads
    got = axis.all_to_all(torch.empty_like(send), send)
    # (b, H/cp, s, hd) in rank order: chunks [0, 2cp-1, 1, 2cp-2, ...]
    full = got.movedim(0, 2).flatten(2, 3)
    natural = torch.argsort(torch.as_tensor(order)).tolist()  # where chunk i sits in rank order
    return full.unflatten(2, (len(order), -1))[:, :, natural].flatten(2, 3)


def _heads_to_seq(x, axis, order):
    """The inverse of _seq_to_heads."""
    n = axis.size  # x: (b, H/cp, s, hd)
    # (b, H/cp, cp, s_l, hd)
    ranked = x.unflatten(2, (len(order), -1))[:, :, order].flatten(2, 3).unflatten(2, (n, -1))
    # (cp, b, H/cp, s_l, hd): rank j's tokens go back to rank j
    send = ranked.movedim(2, 0).contiguous()
    # (cp, b, H/cp, s_l, hd): head group i from rank i
    got = axis.all_to_all(torch.empty_like(send), send)
    return got.movedim(0, 1).flatten(1, 2)  # (b, H, s_l, hd)


class SwapSharding(torch.autograd.Function):
    """to_heads: _seq_to_heads forward, _heads_to_seq backward; else the other way round."""

    @staticmethod
    def forward(ctx, x, axis, order, to_heads):
        ctx.axis, ctx.order, ctx.to_heads = axis, order, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, axis, order)

    @staticmethod
    def backward(ctx, grad):
        return (
            (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.axis, ctx.order),
            None,
            None,
            None,
        )


def ulysses(q, k, v, axis, layout, scale):
    """All-to-all to head shards, attention over the whole sequence with H/cp heads, all-to-all
    back."""
    order = [c for j in range(axis.size) for c in layout.chunks(j)]  # the chunks in rank order
    q, k, v = (SwapSharding.apply(t, axis, order, True) for t in (q, k, v))
    # (b, 1, s, s): causal, one document
    mask = None if layout.docs is None else document_mask(layout.docs)
    WORK["flops"] += 4 * q.shape[0] * q.shape[1] * q.shape[2] ** 2 * q.shape[3] // 2
    y = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return SwapSharding.apply(y, axis, order, False)


# ---------------------------------------------------------------- the attention core, and the model
# transform
def attention(q, k, v, axis, method="ring", docs=None, balanced=True):
    """softmax(q k^T / sqrt(d), causal [, documents]) v with q, k, v (b, heads, s/cp, hd) this
    rank's tokens (chunks_of) and the result likewise; docs: (b, s) document ids of the whole
    sequences, or None."""
    s = q.shape[2] * axis.size
    layout = Layout(axis.size, axis.rank, s, docs, balanced)
    scale = 1.0 / math.sqrt(q.shape[-1])
    # MLA (mla.py): v's head size is not q's and k's; all travel zero-padded to one (the cores stack
    # k and v): zeros change no score, and the output's padded columns are dropped
    d_v, width = v.shape[-1], max(v.shape[-1], q.shape[-1])
    if d_v != q.shape[-1]:
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
    if method == "ulysses":
        out = ulysses(q, k, v, axis, layout, scale)
    else:
        fn = RingAttention if method == "ring" else AllGatherAttention
        out = fn.apply(q, k, v, axis, layout, scale)
    return out if d_v == width else out[..., :d_v]


def check(cfg, cp, method, tp=1):
    """One line for what this context parallelism cannot do, raised before any collective."""
    if method not in METHODS:
        raise ValueError(f"--cp-method {method!r} is not one of {', '.join(METHODS)}")

    if cp > 1 and cfg.block_size % (2 * cp):
        raise ValueError(
            f"--cp {cp} needs --block-size {cfg.block_size} divisible by 2 x cp = {2 * cp} "
            f"(each rank holds a head and a tail chunk)"
        )
    if cp > 1 and (cfg.alibi or cfg.dropout > 0):
        raise ValueError(
            "--cp with --alibi or --dropout > 0: the context-parallel attention core has no ALiBi "
            "bias and no attention dropout; leave them out"
        )

    # dynamic NTK's frequencies follow the sequence's length; a cp rank sees only its chunks
    if cp > 1 and cfg.arch == "llama" and cfg.rope_type == "dynamic" and cfg.rope_scaling != 1.0:
        raise ValueError(
            f"--rope-type dynamic with --cp {cp}: its frequencies follow the sequence's length, and "
            f"a cp rank sees only its own chunks' positions, so its table would not be one "
            f"process's; use --cp 1 or another --rope-type"
        )

    # this rank's key/value heads (tp replicates a group when tp > n_kv)
    kv = max(1, cfg.kv_heads // tp)
    if cp > 1 and method == "ulysses" and (cfg.n_head // tp % cp or kv % cp):
        raise ValueError(
            f"--cp-method ulysses needs --cp {cp} to divide the heads per tp rank: n_head/tp = "
            f"{cfg.n_head // tp}, key/value heads {kv}; use --cp-method ring or allgather"
        )


@functools.lru_cache(maxsize=8)
def local_positions(cp, rank, s_local):
    """The `positions` entry under cp: (s_local,) the positions of this rank's s_local tokens (CPU,
    cached)."""
    return positions(s_local * cp, cp, rank)


def core(attn, q, k, v, docs=None, *, axis, method="ring"):
    """The `core` entry under cp (seams.Ops): attention over the cp axis for attn's heads."""
    return attention(q, k, v, axis, method, docs)


def apply_context_parallel(model, axis, method="ring"):
    """In place: two entries of every table replaced -- the attention core attends over the cp axis,
    and the positions (learned or rotary) are this rank's chunks' (positions). The model then takes
    this rank's tokens (local), and the whole windows' document ids (b, s) if any (documents.py),
    and returns the mean loss over its tokens; weights are unchanged (replicated over cp: their
    gradients are summed over dp_cp, zero.py)."""
    if axis.size == 1:
        return model
    check(model.cfg, axis.size, method)
    model.replace_op("positions", functools.partial(local_positions, axis.size, axis.rank))
    model.replace_op(
        "core", functools.partial(core, axis=axis, method=method)
    )  # recompute wraps it too
    return model
