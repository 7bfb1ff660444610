"""The dense GPT (GPT-2/GPT-3 family, and the Llama family): the reference every parallel technique
is checked against.

Idea: pre-norm blocks between an embedding and an LM head (tied or not), from small named pieces
(Embedding, CausalSelfAttention, MLP, Block, Head) that compute through their block's op table
(seams.Ops): tp.py, cp.py, fused.py and recompute.py replace entries (GPT.replace_op), pp.py keeps
some pieces on a stage -- no second model file. arch="llama" composes modern.py's pieces. Its
shape: GPTConfig (gpt_config.py). Initialization (initialization.py): a rule per parameter name and
a draw whose element i depends on (seed, name, i) alone, so a rank draws just its slice of the dense
model's values, bitwise (meta.py).
Formulas (GPT-2; Llama's: modern.py; MoE: moe.py):
    parameters   N ~= 12 L h^2 + V h   (+ s h learned positions)
    FLOPs/token  6 N' + 12 L h s        (N' = N without position embeddings; 12 L h s: QK^T and AV,
                                         2*2*s*h per layer forward, x3 for fwd+bwd)
Lesson: lessons/01-dense-model.md
"""

import contextlib
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import mla, moe, mtp
from .gpt_config import GPTConfig
from .initialization import draw, init_std
from .modern import RMSNorm, Rotary, document_mask, rms_norm, swiglu
from . import seams
from .seams import LayerNorm, Linear, Ops, call, in_order, layer_norm


def bias_gelu(x, bias):
    """GeLU(x + bias), tanh approximation as GPT-2. fused.py swaps in a one-pass kernel."""
    return F.gelu(x + bias, approximate="tanh")


def causal_softmax(scores, scale):
    """softmax(scores * scale) over the last dim with future keys masked; fp32 inside, input dtype
    out."""
    s_q, s_k = scores.shape[-2:]
    future = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu(s_k - s_q + 1)
    probs = torch.softmax((scores.float() * scale).masked_fill(future, float("-inf")), dim=-1)
    return probs.to(scores.dtype)


def alibi_slopes(n_head: int) -> torch.Tensor:
    """ALiBi head slopes 2^(-8i/n) (Press et al. 2022), with the paper's rule for n not a power of
    2. On the CPU even inside `with torch.device("meta")`: a buffer computed from the config, never
    drawn (meta.py moves it)."""

    def powers(n):
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 2 ** math.floor(math.log2(n_head))
    slopes = powers(p) + powers(2 * p)[0::2][: n_head - p]
    return torch.tensor(slopes, device="cpu")


def eager_core(attn, q, k, v, docs=None):
    """softmax(q k^T / sqrt(d) [+ alibi], causal [, in one document: docs]) v, the explicit form:
    the scores (b, nh, s, s) are stored, the softmax is the table's (fused.py swaps in one pass). k,
    v may have fewer heads than q (grouped-query): each serves n_head / n_kv query heads."""
    scale = 1.0 / math.sqrt(attn.head_dim)
    # grouped-query: query head i reads key/value head i // (nh / n_kv)
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    # 16 bits: scale q first, or q.k (up to d * |q| |k|) overflows fp16
    if q.dtype != torch.float32:
        q, scale = q * scale, 1.0
    scores = q @ k.transpose(-2, -1)  # (b, nh, s, s)
    if attn.slopes is not None:  # bias -slope*(i-j), divided by scale: the softmax rescales all
        scores = scores + attn.alibi_bias(q.shape[-2], scores.dtype) / scale
    # other documents' keys: the dtype's most negative finite (a fused softmax takes no inf)
    if docs is not None:
        scores = scores.masked_fill(~document_mask(docs), torch.finfo(scores.dtype).min)
    probs = attn.attn_drop(attn.ops.softmax(scores, scale))
    return probs @ v  # (b, nh, s, hd)


def sdpa_core(attn, q, k, v, docs=None):
    """The same attention in one F.scaled_dot_product_attention call (FlashAttention /
    memory-efficient kernels on CUDA, a fused kernel on CPU): the (b, nh, s, s) scores are never
    stored."""
    drop, mask = (attn.attn_drop.p if attn.training else 0.0), None
    if attn.slopes is not None:  # ALiBi: an additive float mask, the causal -inf included
        s = q.shape[-2]
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)  # key j > query i
        mask = attn.alibi_bias(s, q.dtype).masked_fill(future, float("-inf"))
    # --document-mask: causal and inside one document (and ALiBi's bias, if any)
    if docs is not None:
        same = document_mask(docs)
        mask = same if mask is None else mask.masked_fill(~same, float("-inf"))
    # tensor parallel dropout (rng.TrackedDropout): each rank's heads draw from its own stream
    fork = getattr(attn.attn_drop, "rng", None)
    with fork.fork() if fork is not None and drop > 0 else contextlib.nullcontext():
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=drop,
            is_causal=mask is None,
            enable_gqa=k.shape[1] != q.shape[1],
        )


def block_ops(cfg: GPTConfig) -> Ops:
    """A block's table, the dense math: F.linear, the core --attention names (fused: the eager core,
    whose softmax train.py makes the fused kernel), LayerNorm / bias-GeLU (gpt2) or RMSNorm / SwiGLU
    (llama)."""
    llama = cfg.arch == "llama"
    return Ops(
        linear=F.linear,
        core=sdpa_core if cfg.attention == "sdpa" else eager_core,
        softmax=causal_softmax,
        norm=rms_norm if llama else layer_norm,
        activation=swiglu if llama else bias_gelu,
        positions=in_order,
        layer=call,
    )


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.wpe = (
            None if cfg.alibi or cfg.arch == "llama" else nn.Embedding(cfg.block_size, cfg.n_embd)
        )
        # the entries this piece uses
        norm = layer_norm if cfg.embed_layernorm else None
        self.ops = Ops(norm=norm, positions=None if self.wpe is None else in_order)
        self.ln = LayerNorm(cfg.n_embd, ops=self.ops) if cfg.embed_layernorm else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx, positions=None):  # (b, s) -> (b, s, h); positions (s,) or None
        x = self.wte(idx)
        if self.wpe is not None:
            pos = self.ops.positions(idx.shape[1]) if positions is None else positions
            pos = torch.arange(idx.shape[1], device=idx.device) if pos is None else pos
            x = x + self.wpe(pos.to(idx.device))
        return self.drop(x if self.ln is None else self.ln(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, ops: Ops, rotary=None):
        super().__init__()
        h, self.n_head, self.n_kv_head = cfg.n_embd, cfg.n_head, cfg.kv_heads
        self.head_dim = h // cfg.n_head
        self.ops = ops
        # llama: q by heads; k and v stacked (2, n_kv, hd) by rows; biases only with qkv_bias (Qwen2)
        if cfg.arch == "llama":
            self.q_proj = Linear(h, h, bias=cfg.qkv_bias, ops=ops)
            kv = 2 * self.n_kv_head * self.head_dim
            self.kv_proj = Linear(h, kv, bias=cfg.qkv_bias, ops=ops)
        else:
            self.c_attn = Linear(h, 3 * h, ops=ops)  # output laid out as (3, n_head, head_dim)
        self.c_proj = Linear(h, h, bias=cfg.arch != "llama", ops=ops)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.rotary = rotary  # modern.Rotary (llama), shared by every layer; None: the embedding's
        # Qwen3's QK-norm: one RMSNorm scale (hd,) for every query head, one for every key head;
        # OLMoE's (qk_norm_whole): one RMSNorm over the whole q projection (h), one over k's
        self.whole = cfg.qk_norm_whole
        q_width, k_width = (h, kv // 2) if self.whole else (self.head_dim, self.head_dim)
        norms = cfg.qk_norm or self.whole
        self.q_norm = RMSNorm(q_width, cfg.norm_eps, ops=ops) if norms else None
        self.k_norm = RMSNorm(k_width, cfg.norm_eps, ops=ops) if norms else None
        # ALiBi slopes of the heads this module holds (tp.py keeps only its own heads' slopes)
        self.register_buffer(
            "slopes", alibi_slopes(cfg.n_head) if cfg.alibi else None, persistent=False
        )

    def forward(self, x, docs=None, positions=None):  # SP: x (b, s/tp, h), gathered in project
        q, k, v = self.project(x)  # (b, nh, s, hd), (b, n_kv, s, hd), (b, n_kv, s, hd)
        b, s = q.shape[0], q.shape[2]
        if self.rotary is not None:
            pos = self.ops.positions(s) if positions is None else positions
            q, k = self.rotary(q, pos), self.rotary(k, pos)
        y = self.core(q, k, v, docs).transpose(1, 2).reshape(b, s, self.n_head * self.head_dim)
        return self.resid_drop(self.c_proj(y))

    def project(self, x):
        if hasattr(self, "c_attn"):
            qkv = self.c_attn(x)  # (b, s, 3h)
            b, s = qkv.shape[:2]
            return qkv.view(b, s, 3, self.n_head, self.head_dim).permute(
                2, 0, 3, 1, 4
            )  # (b, nh, s, hd) each
        q = self.q_proj(x)  # (b, s, h)
        b, s = q.shape[:2]
        q = q.view(b, s, self.n_head, self.head_dim)
        k, v = self.kv_proj(x).view(b, s, 2, self.n_kv_head, self.head_dim).unbind(2)
        if self.whole:  # each token's q and k normalized over all their heads
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        elif self.q_norm is not None:  # (b, s, heads, hd): each head normalized over hd
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def core(self, q, k, v, docs=None):
        """The table's attention core on this module's heads (what selective recompute
        recomputes)."""
        return self.ops.core(self, q, k, v, docs)

    def alibi_bias(self, s, dtype):
        """(nh, s, s) ALiBi bias slope_h * (j - i): 0 on the diagonal, more negative for older
        keys."""
        pos = torch.arange(s, device=self.slopes.device)
        dist = (pos[None, :] - pos[:, None]).to(dtype)  # (s, s): j - i <= 0 where unmasked
        return self.slopes.to(dtype)[:, None, None] * dist


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False, ops=ops)
        self.fc_bias = nn.Parameter(torch.zeros(4 * cfg.n_embd))  # kept apart so bias+GeLU can fuse
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, ops=ops)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (b, s, h) -> (b, s, 4h) -> (b, s, h)
        return self.drop(self.c_proj(self.ops.activation(self.c_fc(x), self.fc_bias)))


def norm(cfg: GPTConfig, ops: Ops) -> nn.Module:
    """The block's normalization: LayerNorm (gpt2) or RMSNorm (llama), its arithmetic the table's
    norm."""
    if cfg.arch == "llama":
        return RMSNorm(cfg.n_embd, cfg.norm_eps, ops=ops)
    return LayerNorm(cfg.n_embd, cfg.norm_eps, ops=ops)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, rotary=None, layer=0):
        super().__init__()
        self.ops = block_ops(cfg)  # this block's swappable ops: every piece below calls them
        self.ln_1 = norm(cfg, self.ops)
        # multi-head (or grouped-query) attention, or latent attention (mla.py)
        attention = mla.LatentAttention if cfg.kv_lora_rank else CausalSelfAttention
        self.attn = attention(cfg, self.ops, rotary)
        self.ln_2 = norm(cfg, self.ops)
        # SwiGLU, or experts (moe.py; a dense SwiGLU in the first first_k_dense layers)
        self.mlp = moe.mlp(cfg, self.ops, layer) if cfg.arch == "llama" else MLP(cfg, self.ops)

    def forward(self, x, docs=None, positions=None):  # docs: (b, s) document ids or None
        return self.ops.layer(self.body, x, docs, positions)

    def body(self, x, docs=None, positions=None):
        x = x + self.attn(self.ln_1(x), docs, positions)
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ops = Ops(
            linear=F.linear,
            norm=rms_norm if cfg.arch == "llama" else layer_norm,
            loss=functools.partial(cross_entropy, vocab_size=cfg.vocab_size),
        )
        self.ln_f = norm(cfg, self.ops)
        self.lm_head = Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False, ops=self.ops)

    def forward(self, x, targets=None):
        logits = self.lm_head(self.ln_f(x))  # (b, s, V)
        return logits if targets is None else self.ops.loss(logits, targets)


def cross_entropy(logits, targets, vocab_size=None):
    """Mean token loss in fp32 (BLOOM: never the loss in half precision); -1 marks ignored targets.
    The padded vocabulary rows (there only so tp can split V) are left out: GPT-2's loss over 50,257
    tokens, not 50,304."""
    return F.cross_entropy(
        logits[..., :vocab_size].float().flatten(0, -2), targets.flatten(), ignore_index=-1
    )


class GPT(nn.Module):
    """The dense model. seed: its initialization (init_weights); built inside `with
    torch.device("meta")` it holds shapes only, and meta.py draws each rank's slices of the same
    values."""

    def __init__(self, cfg: GPTConfig, seed=None):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        rotary = (
            Rotary(
                cfg.rope_head_dim,
                cfg.rope_theta,
                cfg.rope_scaling,
                cfg.rope_type,
                cfg.rope_original_context,
            )
            if cfg.arch == "llama"
            else None
        )
        if cfg.rope_mscale_all_dim:  # DeepSeek's YaRN: cos, sin unscaled (mla.py scales scores)
            rotary.factor = 1.0
        self.blocks = nn.ModuleDict({str(i): Block(cfg, rotary, i) for i in range(cfg.n_layer)})
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.lm_head.weight = self.embed.wte.weight  # tied (pp.py unties across stages)
        # DeepSeek-V3's multi-token prediction: D modules after the trunk, a block each (mtp.py)
        blocks = [Block(cfg, rotary) for _ in range(cfg.mtp_num_layers)]
        self.mtp = mtp.MultiTokenPrediction(cfg, blocks, norm) if blocks else None
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed=None):
        """Every parameter drawn by its name (init_std, draw). seed None: one drawn from torch's
        default generator, so `torch.manual_seed(s); GPT(cfg)` is reproducible. On the meta device:
        nothing to write."""
        seed = int(torch.randint(1 << 62, (), device="cpu")) if seed is None else seed
        for name, p in self.named_parameters():
            if not p.is_meta:
                p.copy_(draw(seed, name, init_std(name, self.cfg.n_layer), 0, p.numel()).view_as(p))

    def forward(self, x, targets=None, docs=None, positions=None):
        """x: token ids (b, s) on the first stage, hidden states (b, s, h) later; docs: (b, s)
        document ids or None; positions: (s,) the tokens' positions, or None: the tables' (0 .. s-1,
        or cp's chunks)."""
        if self.embed is not None:
            x = self.embed(x, positions)
        for block in self.blocks.values():
            x = block(x, docs, positions)
        return x if self.head is None else self.output(x, targets, docs, positions)

    def output(self, x, targets=None, docs=None, positions=None):
        """The head on the last hidden state x: logits, or the loss; in training with MTP modules,
        their loss joins the LM loss's backward (mtp.py: the embedding is the first stage's, or the
        head's tied copy on a pipeline's last stage)."""
        out = self.head(x, targets)
        if self.mtp is None or targets is None or not torch.is_grad_enabled():
            return out
        weight = self.head.lm_head.weight  # tied: the embedding, or its last-stage copy
        embed = (
            self.embed.wte
            if self.embed is not None
            else functools.partial(F.embedding, weight=weight)
        )
        return self.mtp(x, out, targets, embed, self.head, docs, positions)

    # ---- the swappable ops (seams.py): one table per block, the embedding's and the head's
    def op_tables(self) -> dict:
        """{"embed" | block key | "head": Ops} of the pieces this rank holds."""
        tables = {} if self.embed is None else {"embed": self.embed.ops}
        tables.update({key: block.ops for key, block in self.blocks.items()})
        if self.mtp is not None:  # the MTP modules' blocks (mtp.py)
            tables.update({f"mtp.{k}": depth.block.ops for k, depth in self.mtp.depths.items()})
        return tables if self.head is None else {**tables, "head": self.head.ops}

    def replace_op(self, name, fn, blocks=None):
        """THE call by which a technique swaps an op: entry `name` becomes fn in every table that
        uses it (blocks: only these block keys' tables, e.g. recompute's first k layers)."""
        seams.replace(self.op_tables(), name, fn, blocks)

    def ops_table(self) -> str:
        """Which function computes each entry of each table: `print(model.ops_table())`."""
        return seams.render(self.op_tables())
