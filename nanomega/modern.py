"""The modern block: what Llama changed in GPT-2's block -- rotary positions, RMSNorm, SwiGLU,
grouped-query attention -- and packed documents kept apart (document_mask).

Idea: RoPE rotates q and k by an angle proportional to their position, so q.k depends on i - j only;
RMSNorm is LayerNorm without the mean and the bias; SwiGLU is a gated MLP of three h x f matrices, f
= 2/3 of 4h (ffn_hidden) keeping GPT-2's 8h^2; GQA lets n_kv < n_head key/value heads each serve
n_head / n_kv query heads. model.py composes them when GPTConfig.arch == "llama"; fused.py and tp.py
act on them through the block's op table (seams.py).
Formulas (h hidden, a heads, g = a / n_kv, f MLP hidden; one home: formulas.py):
    parameters per layer  2h^2 (q, o) + 2h^2/g (k, v) + 3hf (gate, up, down) + 2h (two RMSNorm scales)
    FLOPs per token       6N + 12 L h s, as GPT-2's (GQA changes N, not the attention matmuls)
Lesson: lessons/02-the-modern-block.md
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .seams import Linear, Ops

# Llama 3.1's frequency scaling (its params.json: low 1, high 4, original context 8192; factor 8 in
# 3.1, 32 in 3.2)
LLAMA3_LOW_FREQ, LLAMA3_HIGH_FREQ, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192
# YaRN's ramp (Peng et al. 2023; transformers' defaults): dimensions turning more than 32 times over
# the original context kept, fewer than once interpolated
YARN_BETA_FAST, YARN_BETA_SLOW = 32, 1


def ffn_hidden(h, multiplier=1.0, multiple_of=256):
    """Llama's MLP width: 2/3 of 4h (so 3 matrices hold GPT-2's 8h^2), times ffn_dim_multiplier,
    rounded up to multiple_of. Llama 3 8B: 14336 (1.3, 1024); 70B: 28672 (1.3, 4096); 405B: 53248
    (1.2, 4096)."""
    f = int(multiplier * int(2 * 4 * h / 3))
    return multiple_of * -(-f // multiple_of)


def rope_frequencies(head_dim, theta=10000.0, scaling=1.0, kind="llama3", original=8192, seq=0):
    """((head_dim/2,) fp32 inverse frequencies, attention factor), on the CPU even inside a meta
    context: theta^(-2i/d), rescaled when scaling > 1 by the rule `kind` as transformers defines it
    (its ROPE_INIT_FUNCTIONS; `original`: the pretraining context, `seq`: the sequence length,
    which only dynamic reads). The attention factor multiplies cos and sin (YaRN's; else 1)."""
    inv = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    )
    if scaling == 1.0:
        return inv, 1.0

    # linear (position interpolation): every frequency divided by the factor
    if kind == "linear":
        return inv / scaling, 1.0

    # dynamic NTK: past the original context, a larger base for the sequence's length
    if kind == "dynamic":
        base = theta * (scaling * max(seq, original) / original - (scaling - 1)) ** (
            head_dim / (head_dim - 2)
        )
        return rope_frequencies(head_dim, base)

    # YaRN: high frequencies kept, low ones interpolated, a linear ramp between (in dimensions)
    if kind == "yarn":

        def dim_of(rotations):  # the dimension that turns `rotations` times over the context
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(dim_of(YARN_BETA_FAST)), 0)
        high = min(math.ceil(dim_of(YARN_BETA_SLOW)), head_dim - 1)
        high += 0.001 if low == high else 0  # no division by 0
        ramp = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
        ramp = ((ramp - low) / (high - low)).clamp(0, 1)
        pos = theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
        kept = 1 - ramp  # 1: extrapolated (kept), 0: interpolated
        inv = 1.0 / (scaling * pos) * (1 - kept) + 1.0 / pos * kept
        return inv, 0.1 * math.log(scaling) + 1.0 if scaling > 1 else 1.0

    # llama3: wavelengths longer than original / LOW stretched by the factor, shorter than
    # original / HIGH kept, the band between interpolated smoothly
    wavelen = 2 * math.pi / inv
    # 0 long ... 1 short
    smooth = (original / wavelen - LLAMA3_LOW_FREQ) / (LLAMA3_HIGH_FREQ - LLAMA3_LOW_FREQ)
    stretched = torch.where(wavelen > original / LLAMA3_LOW_FREQ, inv / scaling, inv)
    between = (wavelen >= original / LLAMA3_HIGH_FREQ) & (wavelen <= original / LLAMA3_LOW_FREQ)
    return torch.where(
        between, (1 - smooth) * stretched / scaling + smooth * stretched, stretched
    ), 1.0


class Rotary:
    """RoPE in Hugging Face's rotate-half layout: the pairs are (x_i, x_{i + d/2}), rotated by
    position * inv_freq_i. Not a module and no buffer: the tables are computed from the config on
    the host in fp32 (so a bf16 cast of the model never rounds the frequencies), cached per device
    and dtype, grown to the longest sequence seen and sliced; one Rotary is shared by every layer of
    a model. Dynamic NTK's frequencies depend on the sequence's length: a table per length past the
    original context."""

    def __init__(self, head_dim, theta=10000.0, scaling=1.0, kind="llama3", original=8192):
        self.rule = (head_dim, theta, scaling, kind, original)
        self.inv_freq, self.factor = rope_frequencies(*self.rule)  # (hd/2,), YaRN's factor
        self.dynamic = kind == "dynamic" and scaling != 1.0
        self.tables = {}  # (device, dtype, length past the original context or 0) -> (cos, sin)

    def table(self, s, device, dtype):
        past = s if self.dynamic and s > self.rule[4] else 0
        cos_sin = self.tables.get((device, dtype, past))
        if cos_sin is None or cos_sin[0].shape[0] < s:
            inv = rope_frequencies(*self.rule, seq=s)[0] if past else self.inv_freq
            angle = torch.outer(torch.arange(s, dtype=torch.float32), inv)  # (s, hd/2)
            # (s, hd): both halves of a pair share an angle
            angle = torch.cat((angle, angle), dim=-1)
            cos_sin = self.tables[(device, dtype, past)] = (
                (angle.cos() * self.factor).to(device, dtype),
                (angle.sin() * self.factor).to(device, dtype),
            )
        return cos_sin[0][:s], cos_sin[1][:s]

    def __call__(self, x, pos=None):  # (b, heads, s, hd) -> rotated; pos: (s,) (CPU) or None
        cos, sin = self.table(x.shape[-2] if pos is None else int(pos.max()) + 1, x.device, x.dtype)
        if pos is not None:  # the rows of this rank's chunks
            cos, sin = cos[pos.to(x.device)], sin[pos.to(x.device)]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rms_norm(x, weight, eps=1e-5):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, fp32 inside (as HF's LlamaRMSNorm), x's
    dtype out before the scale. fused.py swaps in a one-pass kernel."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight; its arithmetic is the table's norm entry (rms_norm, or fused.py's
    kernel)."""

    def __init__(self, h, eps=1e-5, *, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps, self.ops = eps, ops

    def forward(self, x):
        return self.ops.norm(x, self.weight, self.eps)


def swiglu(gate_up):
    """silu(gate) * up of a (..., 2f) tensor laid out [gate | up] (one matmul makes both). fused.py
    fuses it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """Llama's MLP: down(silu(x W_gate) * x W_up). gate and up are one (2f, h) weight, [gate; up] by
    rows, so tensor parallelism splits each half by columns (tp.py's rule: 2 interleaved groups) in
    one matmul."""

    def __init__(self, h, f, dropout=0.0, *, ops: Ops):
        super().__init__()
        self.ops = ops  # the block's table: linear, activation (swiglu)
        self.gate_up = Linear(h, 2 * f, bias=False, ops=ops)  # (b, s, h) -> (b, s, 2f)
        self.c_proj = Linear(f, h, bias=False, ops=ops)  # down: (b, s, f) -> (b, s, h)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.c_proj(self.ops.activation(self.gate_up(x))))


def document_mask(docs):
    """(b, 1, s, s) bool, True where query i may attend key j: j <= i and both in one document (docs
    (b, s) document ids). Positions stay absolute: the mask alone keeps packed documents apart."""
    causal = torch.ones(docs.shape[1], docs.shape[1], dtype=torch.bool, device=docs.device).tril()
    return (docs[:, None, :, None] == docs[:, None, None, :]) & causal
