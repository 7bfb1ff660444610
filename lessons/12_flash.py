"""Lesson 12: FlashAttention as an algorithm -- tiles, an online softmax, recompute in backward --
in plain PyTorch.

A tiled causal attention, forward and backward, that never holds more than one (block x block) tile
of scores, checked against the naive attention (and PyTorch's SDPA) within a bound derived from the
arithmetic, with the bytes each keeps for backward counted. Run from the repository root: python
lessons/12_flash.py
"""

import math
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from check import check  # noqa: E402
from tolerance import likely, unit_roundoff  # noqa: E402

# batch, heads, sequence, head dim, tile size (rows and columns)
B, A, S, D, BLOCK = 2, 2, 256, 32, 32


def naive(q, k, v):
    """softmax(q k^T / sqrt(d), causal) v: the (b, a, s, s) scores and probabilities exist, and
    autograd keeps P."""
    s = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (b, a, s, s)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def tiles(s, block):
    """(query block i, key block j) pairs a causal kernel computes: j <= i; the blocks above the
    diagonal are all masked, so they are skipped -- about half the s x s square."""
    n = s // block
    return [(i, j) for i in range(n) for j in range(i + 1)]


def tile_scores(q, k, i, j, block):
    """One (block x block) tile of scaled scores, the causal mask applied on the diagonal tile
    only."""
    qi, kj = q[..., i * block : (i + 1) * block, :], k[..., j * block : (j + 1) * block, :]
    t = qi @ kj.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (b, a, block, block)
    if i == j:
        t = t.masked_fill(~torch.ones(block, block, dtype=torch.bool).tril(), float("-inf"))
    return t


def flash_forward(q, k, v, block):
    """O and the log-sum-exp L of every row, one tile of scores at a time: the online softmax keeps
    a running max m, a running sum l of exp(score - m) and an unnormalised output acc; a new tile
    with a larger max rescales l and acc by exp(m_old - m_new) (Milakov & Gimelshein 2018; Dao et
    al. 2022)."""
    b, a, s, d = q.shape
    out, lse = torch.empty_like(q), torch.empty(b, a, s, dtype=q.dtype)
    for i in range(s // block):
        m = torch.full((b, a, block), float("-inf"), dtype=q.dtype)  # running max per row
        l = torch.zeros(b, a, block, dtype=q.dtype)  # running sum of exp(score - m)
        acc = torch.zeros(b, a, block, d, dtype=q.dtype)  # running sum of exp(score - m) v
        for j in range(i + 1):  # causal: key blocks after the query block are never computed
            t = tile_scores(q, k, i, j, block)
            m_new = torch.maximum(m, t.amax(-1))
            p = torch.exp(t - m_new[..., None])
            rescale = torch.exp(m - m_new)  # 0 on the first tile (m = -inf), then <= 1
            l = l * rescale + p.sum(-1)
            acc = acc * rescale[..., None] + p @ v[..., j * block : (j + 1) * block, :]
            m = m_new
        out[..., i * block : (i + 1) * block, :] = acc / l[..., None]
        lse[..., i * block : (i + 1) * block] = m + torch.log(l)
    return out, lse


def flash_backward(q, k, v, out, lse, dout, block):
    """FlashAttention-2's backward: P is recomputed tile by tile from q, k and the saved L (P =
    exp(S - L)), never stored; D = rowsum(dO * O) replaces the softmax Jacobian's row sums (dS = P *
    (dP - D))."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    rows = (dout * out).sum(-1)  # (b, a, s): D
    scale = 1 / math.sqrt(q.shape[-1])
    for i, j in tiles(q.shape[-2], block):
        qs, ks = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
        # the recompute: (b, a, block, block)
        p = torch.exp(tile_scores(q, k, i, j, block) - lse[..., qs, None])
        dv[..., ks, :] += p.transpose(-1, -2) @ dout[..., qs, :]
        dp = dout[..., qs, :] @ v[..., ks, :].transpose(-1, -2)
        ds = p * (dp - rows[..., qs, None])
        dq[..., qs, :] += ds @ k[..., ks, :] * scale
        dk[..., ks, :] += ds.transpose(-1, -2) @ q[..., qs, :] * scale
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    """Saves q, k, v, O and L -- 4 (b, a, s, d) tensors and one (b, a, s) -- never a score."""

    @staticmethod
    def forward(ctx, q, k, v, block):
        out, lse = flash_forward(q, k, v, block)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, dout):
        return (*flash_backward(*ctx.saved_tensors, dout, ctx.block), None)


def saved_bytes(fn, *inputs):
    """Bytes autograd keeps for backward (each storage once), counted with saved_tensors_hooks."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return out, sum(seen.values())


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    q, k, v = (torch.randn(B, A, S, D, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, A, S, D)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = naive(*ref)
    ref_out.backward(dout.double())

    # 1. forward: equal within a bound from the arithmetic. Per score: a d-term dot product (likely(d)
    # of the sum of |q_t k_t|); a score error e moves P by a relative 2e (numerator and the row sum);
    # exp ~2u; each of the T key tiles' rescales one rounding on l and on acc (2Tu); the row sums of P
    # and of P v, likely(s) each; the division u.
    u, T = unit_roundoff(torch.float32), S // BLOCK
    e_score = (
        likely(D)
        * ((q.detach().abs() @ k.detach().abs().transpose(-1, -2)) / math.sqrt(D)).max().item()
    )
    rel = 2 * e_score + 2 * u + 2 * T * u + 2 * likely(S) + u
    p_ref = torch.softmax(
        (ref[0] @ ref[1].transpose(-1, -2) / math.sqrt(D)).masked_fill(
            ~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf")
        ),
        -1,
    ).detach()
    bound = rel * (p_ref @ ref[2].detach().abs())  # relative to sum_j P_ij |v_j|, elementwise
    flash_out, flash_saved = saved_bytes(FlashAttention.apply, q, k, v, BLOCK)
    naive_out, naive_saved = saved_bytes(naive, q, k, v)
    sdpa_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for name, got in (
        ("tiled online softmax", flash_out),
        ("naive, fp32", naive_out),
        ("SDPA", sdpa_out),
    ):
        ratio = ((got.detach().double() - ref_out.detach()).abs() / bound).max().item()
        print(
            f"{name:>20}: worst |O - O_fp64| = {ratio:.3f} x the bound (relative bound {rel:.2e})"
        )
        check(
            f"{name} forward within the bound from the arithmetic (1 = every element)",
            int(ratio <= 1),
            1,
        )

    # 2. backward: P recomputed from L. Each gradient is a sum of products whose factors carry the
    # forward's relative error (rel, on P and on D) plus one sum of <= s terms: bound (2 rel +
    # likely(s)) x the same sum in |values|.
    flash_out.backward(dout)
    dp_abs = dout.abs().double() @ ref[2].detach().abs().transpose(-1, -2)  # |dO| |v|^T
    rows_abs = (dout.abs().double() * ref_out.detach().abs()).sum(-1, keepdim=True)
    ds_abs = p_ref * (dp_abs + rows_abs)  # |dS| <= P (|dP| + |D|)
    g_rel = 2 * rel + likely(S)
    abs_sums = {
        "dq": ds_abs @ ref[1].detach().abs() / math.sqrt(D),
        "dk": ds_abs.transpose(-1, -2) @ ref[0].detach().abs() / math.sqrt(D),
        "dv": p_ref.transpose(-1, -2) @ dout.abs().double(),
    }
    worst = max(
        ((g.grad.double() - r.grad).abs() / (g_rel * abs_sums[n])).max().item()
        for n, g, r in zip(("dq", "dk", "dv"), (q, k, v), ref)
    )
    print(f"backward (P recomputed from L): worst |grad - grad_fp64| = {worst:.3f} x the bound")
    check("tiled backward: dq, dk, dv within the bound (1 = every element)", int(worst <= 1), 1)

    # 3. the memory it avoids: the naive attention keeps the (b, a, s, s) probabilities; the tiled one
    # keeps O and L
    print(
        f"saved for backward: naive {naive_saved:,} B, tiled {flash_saved:,} B; largest score tile alive "
        f"{B * A * BLOCK * BLOCK * 4:,} B against the full {B * A * S * S * 4:,} B"
    )
    check(
        "tiled saves q, k, v, O and L = 4 b a s (4d + 1) bytes",
        flash_saved,
        4 * B * A * S * (4 * D + 1),
    )
    check(
        "naive saves q, k, v (4 b a s 3d) + the probabilities (4 b a s^2) + the bool mask (s^2)",
        naive_saved,
        4 * B * A * S * 3 * D + 4 * B * A * S * S + S * S,
    )

    # 4. causal tiles: the kernel computes the tiles on and below the diagonal only
    n = S // BLOCK
    check(
        "causal tiles computed / all tiles = (T + 1) / (2T), T = s / block",
        len(tiles(S, BLOCK)) / n**2,
        (n + 1) / (2 * n),
    )


if __name__ == "__main__":
    main()
