"""The dense GPT (GPT-2/GPT-3 family, and the Llama family): the reference every parallel technique
is checked against.

Idea: pre-norm blocks between an embedding and an LM head (tied or not), from small named pieces
(Embedding, CausalSelfAttention, MLP, Block, Head) that compute through their block's op table
(seams.Ops): tp.py, cp.py, fused.py and recompute.py replace entries (GPT.replace_op), pp.py keeps
some pieces on a stage -- no second model file. arch="llama" composes modern.py's pieces.
Initialization: a rule per parameter name (init_std) and a draw whose element i depends on (seed,
name, i) alone (draw), so a rank draws just its slice of the dense model's values, bitwise
(meta.py).
Formulas (GPT-2; Llama's: modern.py; MoE: moe.py):
    parameters   N ~= 12 L h^2 + V h   (+ s h learned positions)
    FLOPs/token  6 N' + 12 L h s        (N' = N without position embeddings; 12 L h s: QK^T and AV,
                                         2*2*s*h per layer forward, x3 for fwd+bwd)
Lesson: lessons/01-dense-model.md
"""

import contextlib
import functools
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import moe
from .modern import RMSNorm, Rotary, document_mask, ffn_hidden, rms_norm, swiglu
from . import seams
from .seams import LayerNorm, Linear, Ops, call, in_order, layer_norm


# The model's shape: the GPTConfig fields a checkpoint, a preset and the planner agree on
# (checkpoint.py, job/presets.py, tools/cost.py, tools/hf.py read them here). Dropout, attention and
# the vocabulary padding (set by --tp, undone by resharding) are not part of it.
SIZES = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
SHAPE_KEYS = SIZES + (
    "alibi",
    "embed_layernorm",
    "arch",
    "n_kv_head",
    "ffn_hidden",
    "rope_theta",
    "rope_scaling",
    "tie_embeddings",
    "norm_eps",
    "n_experts",
    "top_k",
    "shared_experts",
)
ARCHS = ("gpt2", "llama")
ATTENTION = ("sdpa", "eager", "fused")


@dataclass
class GPTConfig:
    vocab_size: int = 4096
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    alibi: bool = False  # BLOOM: linear attention biases instead of learned positions
    embed_layernorm: bool = False  # BLOOM: a LayerNorm right after the embedding
    # gpt2: LayerNorm, GeLU MLP, biases; llama: RMSNorm, SwiGLU, rotary positions, no biases
    arch: str = "gpt2"
    # key/value heads (grouped-query attention); 0: n_head (multi-head attention)
    n_kv_head: int = 0
    # MLP width; 0: 4h (gpt2), modern.ffn_hidden(h) (llama: 2/3 4h up to a multiple of 256)
    ffn_hidden: int = 0
    rope_theta: float = 10000.0  # llama: RoPE base (Llama 3: 500,000)
    # llama: Llama 3.1's frequency scaling factor (8 in 3.1, 32 in 3.2); 1: none
    rope_scaling: float = 1.0
    # the LM head is the token embedding (GPT-2, Llama 3.2 1B) or its own matrix
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    make_vocab_size_divisible_by: int = 128  # Megatron pads V so each TP shard is a multiple of 128
    # eager (the lessons' explicit softmax; train.py's default: sdpa), sdpa, fused
    attention: str = "eager"
    # mixture of experts (moe.py; llama): each MLP becomes E routed SwiGLU experts of width ffn
    n_experts: int = 0
    top_k: int = 2
    # mixtral: top-k of the logits, softmax over k; deepseek (renormalized), qwen: top-k of E
    router: str = "mixtral"
    moe_aux_loss: float = 0.01  # Switch/GShard load-balancing loss coefficient
    moe_z_loss: float = 0.0  # router z-loss coefficient
    # 0: dropless; else assignments per expert and sequence <= ceil(cf s k / E)
    capacity_factor: float = 0.0
    # experts every token runs through (DeepSeek, Qwen2-MoE), as one wider SwiGLU
    shared_experts: int = 0

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return (self.vocab_size + m - 1) // m * m

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn(self) -> int:
        """The MLP's hidden width f."""
        return self.ffn_hidden or (
            ffn_hidden(self.n_embd) if self.arch == "llama" else 4 * self.n_embd
        )

    def validate(self) -> None:
        for name in SIZES:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.n_embd % self.n_head:
            raise ValueError(
                f"--n-embd {self.n_embd} is not divisible by --n-head {self.n_head}; "
                f"pick n_embd as a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.attention not in ATTENTION:
            raise ValueError(f"--attention {self.attention!r} is not one of {', '.join(ATTENTION)}")
        if self.arch not in ARCHS:
            raise ValueError(f"--arch {self.arch!r} is not one of {', '.join(ARCHS)}")
        if self.n_kv_head < 0 or self.n_head % self.kv_heads:
            raise ValueError(
                f"--n-kv-head {self.n_kv_head} does not divide --n-head {self.n_head}; choose among "
                f"{', '.join(str(d) for d in range(1, self.n_head + 1) if self.n_head % d == 0)}"
            )
        if self.arch == "gpt2" and (self.n_kv_head or self.ffn_hidden or not self.tie_embeddings):
            raise ValueError(
                "--n-kv-head, --ffn-hidden and --untie-embeddings are for --arch llama"
            )
        if self.arch == "llama" and (self.alibi or self.embed_layernorm):
            raise ValueError(
                "--alibi and --embed-layernorm are BLOOM's (--arch gpt2); --arch llama uses rotary "
                "positions and no embedding norm"
            )
        bad = [
            k
            for k in ("rope_theta", "rope_scaling", "norm_eps")
            if not 0 < getattr(self, k) < math.inf
        ]
        # NaN fails both comparisons; the flags' table (job/ranges.py) says this first, an HF config
        # here
        if bad:
            raise ValueError(
                f"--{bad[0].replace('_', '-')} must be a finite number > 0, got {getattr(self, bad[0])}"
            )
        if self.arch == "llama" and (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"--arch llama: rotary positions need an even head size, got n_embd/n_head = "
                f"{self.n_embd // self.n_head}"
            )


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


# ---------------------------------------------------------------- initialization
# elements one generator draws: any element of a parameter is drawn with its block alone
INIT_BLOCK = 1 << 16


def init_std(name, n_layer):
    """GPT-2's initialization as a rule of a parameter's dense name (the same name in every layout):
    biases 0.0, norm scales (LayerNorm, RMSNorm) None (ones), residual projections (c_proj:
    attention's output, the MLP's down) N(0, 0.02/sqrt(2L)), every other matrix N(0, 0.02) -- for
    Llama's q_proj, kv_proj, gate_up too."""
    module, leaf = (["", ""] + name.split("."))[-2:]
    if leaf in ("bias", "fc_bias"):
        return 0.0
    if module.startswith("ln"):
        return None
    return 0.02 / math.sqrt(2 * n_layer) if module == "c_proj" else 0.02


@functools.lru_cache(maxsize=4)  # consecutive runs of a tensor-parallel slice often share a block
def init_block(seed, name, k, std):
    """Block k of parameter `name`: INIT_BLOCK normals from a CPU generator seeded by (seed, name,
    k)."""
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}/{k}".encode()).digest()[:8], "little") >> 1
    return torch.empty(INIT_BLOCK, device="cpu").normal_(
        0.0, std, generator=torch.Generator().manual_seed(key)
    )


def draw(seed, name, std, start, stop):
    """Elements [start, stop) of the flattened parameter `name`, fp32 on the CPU: N(0, std) (0.0:
    zeros, None: ones). A block is always drawn whole, so element i depends on (seed, name, i) only:
    not on the parameter's size (a vocabulary padded further keeps its rows), nor the layout, nor
    the device (drawn on the host). It does depend on the host's vector kernels for normal_: AVX2
    and AVX-512 draw the same bits, a CPU without AVX2 (ATEN_CPU_CAPABILITY=default) others. The
    host holds one block beyond what it returns."""
    out = torch.empty(stop - start, device="cpu")
    if std is None or std == 0.0:
        return out.fill_(1.0 if std is None else 0.0)
    for k in range(start // INIT_BLOCK, -(-stop // INIT_BLOCK)):
        lo, hi = max(start, k * INIT_BLOCK), min(stop, (k + 1) * INIT_BLOCK)
        out[lo - start : hi - start] = init_block(seed, name, k, std)[
            lo - k * INIT_BLOCK : hi - k * INIT_BLOCK
        ]
    return out


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
        if cfg.arch == "llama":  # q by heads; k and v stacked (2, n_kv, hd) by rows; no biases
            self.q_proj = Linear(h, h, bias=False, ops=ops)
            self.kv_proj = Linear(h, 2 * self.n_kv_head * self.head_dim, bias=False, ops=ops)
        else:
            self.c_attn = Linear(h, 3 * h, ops=ops)  # output laid out as (3, n_head, head_dim)
        self.c_proj = Linear(h, h, bias=cfg.arch != "llama", ops=ops)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.rotary = rotary  # modern.Rotary (llama), shared by every layer; None: the embedding's
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
        k, v = self.kv_proj(x).view(b, s, 2, self.n_kv_head, self.head_dim).permute(2, 0, 3, 1, 4)
        return q.view(b, s, self.n_head, self.head_dim).transpose(1, 2), k, v

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
    def __init__(self, cfg: GPTConfig, rotary=None):
        super().__init__()
        self.ops = block_ops(cfg)  # this block's swappable ops: every piece below calls them
        self.ln_1 = norm(cfg, self.ops)
        self.attn = CausalSelfAttention(cfg, self.ops, rotary)
        self.ln_2 = norm(cfg, self.ops)
        # SwiGLU, or experts (moe.py)
        self.mlp = moe.mlp(cfg, self.ops) if cfg.arch == "llama" else MLP(cfg, self.ops)

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
            Rotary(cfg.n_embd // cfg.n_head, cfg.rope_theta, cfg.rope_scaling)
            if cfg.arch == "llama"
            else None
        )
        self.blocks = nn.ModuleDict({str(i): Block(cfg, rotary) for i in range(cfg.n_layer)})
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.lm_head.weight = self.embed.wte.weight  # tied (pp.py unties across stages)
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
        return x if self.head is None else self.head(x, targets)

    # ---- the swappable ops (seams.py): one table per block, the embedding's and the head's
    def op_tables(self) -> dict:
        """{"embed" | block key | "head": Ops} of the pieces this rank holds."""
        tables = {} if self.embed is None else {"embed": self.embed.ops}
        tables.update({key: block.ops for key, block in self.blocks.items()})
        return tables if self.head is None else {**tables, "head": self.head.ops}

    def replace_op(self, name, fn, blocks=None):
        """THE call by which a technique swaps an op: entry `name` becomes fn in every table that
        uses it (blocks: only these block keys' tables, e.g. recompute's first k layers)."""
        seams.replace(self.op_tables(), name, fn, blocks)

    def ops_table(self) -> str:
        """Which function computes each entry of each table: `print(model.ops_table())`."""
        return seams.render(self.op_tables())
