"""The model's shape: GPTConfig, the fields a GPT is built from, and the check that they make one.

Idea: one dataclass names the dense model -- its sizes (V, s, L, a, h), its architecture (gpt2 or
llama) and the options of each (ALiBi, grouped-query heads, the MLP width, RoPE, experts) -- and
validate() refuses a shape no model can have, in one line naming the flag. The derived sizes
(padded_vocab_size, kv_heads, ffn) have their one home here; SHAPE_KEYS are the fields a checkpoint,
a preset and the planner agree on. A module of its own: the flags, presets, checkpoints and the
planner read a shape without building a model (model.py).
Formulas:
    padded V   ceil(V / m) m   (m = make_vocab_size_divisible_by: 128 tp, so each tp shard is a
                               multiple of 128)
    kv heads   n_kv_head or n_head; n_head % kv heads == 0 (each key/value head serves
               n_head / kv heads query heads)
    ffn        ffn_hidden or 4h (gpt2), modern.ffn_hidden(h) (llama: 2/3 4h up to a multiple of 256)
Lesson: lessons/01-dense-model.md
"""

import math
from dataclasses import dataclass

from .modern import ffn_hidden


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
    "rope_type",
    "rope_original_context",
    "rope_mscale_all_dim",
    "qkv_bias",
    "qk_norm",
    "qk_norm_whole",
    "tie_embeddings",
    "norm_eps",
    "n_experts",
    "top_k",
    "shared_experts",
    "shared_expert_gate",
    "first_k_dense",
    "dense_ffn_hidden",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "mtp_num_layers",
)
ARCHS = ("gpt2", "llama")
ATTENTION = ("sdpa", "eager", "fused")
# RoPE scaling rules (modern.rope_frequencies), as transformers names them
ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn")


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
    # llama: RoPE's frequency scaling factor (Llama 3.1: 8, 3.2: 32; Qwen2.5's YaRN: 4); 1: none
    rope_scaling: float = 1.0
    # the rule of rope_scaling (ROPE_TYPES) and the context the model was pretrained at (llama3,
    # yarn; dynamic: where its frequencies start to change)
    rope_type: str = "llama3"
    rope_original_context: int = 8192
    # DeepSeek's YaRN for latent attention (mscale = mscale_all_dim = m; 0: off): cos and sin
    # unscaled, every score x (0.1 m ln(rope_scaling) + 1)^2 (transformers' yarn_apply_mscale)
    rope_mscale_all_dim: float = 0.0
    qkv_bias: bool = False  # llama: biases on q, k and v (Qwen2, Qwen2.5)
    qk_norm: bool = False  # llama: RMSNorm over each head of q and of k before RoPE (Qwen3)
    qk_norm_whole: bool = False  # llama: RMSNorm over the whole q and k projections (OLMoE)
    # the LM head is the token embedding (GPT-2, Llama 3.2 1B) or its own matrix
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    make_vocab_size_divisible_by: int = 128  # Megatron pads V so each TP shard is a multiple of 128
    # eager (the lessons' explicit softmax; train.py's default: sdpa), sdpa, fused
    attention: str = "eager"
    # mixture of experts (moe.py; llama): each MLP becomes E routed SwiGLU experts of width ffn
    n_experts: int = 0
    top_k: int = 2
    # moe.ROUTERS: mixtral, softmax_topk, softmax_topk_norm, deepseek_v3 (old names: moe.RENAMED)
    router: str = "mixtral"
    n_group: int = 1  # deepseek_v3: expert groups (DeepSeek-V3: 8)
    topk_group: int = 1  # deepseek_v3: groups a token may route to (DeepSeek-V3: 4)
    routed_scaling: float = 1.0  # deepseek_v3: the routed weights x this (DeepSeek-V3: 2.5)
    moe_aux_loss: float = 0.01  # Switch/GShard load-balancing loss coefficient
    moe_z_loss: float = 0.0  # router z-loss coefficient
    # 0: dropless; else assignments per expert and sequence <= ceil(cf s k / E)
    capacity_factor: float = 0.0
    # experts every token runs through (DeepSeek, Qwen2-MoE), as one wider SwiGLU
    shared_experts: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE: shared output x sigmoid(x . w_gate)
    # DeepSeek-V3's first_k_dense_replace: blocks 0 .. k-1 keep a dense SwiGLU (the rest MoE), of
    # width dense_ffn_hidden (0: (top_k + shared_experts) ffn, an MoE layer's active width)
    first_k_dense: int = 0
    dense_ffn_hidden: int = 0
    # llama: multi-head latent attention (mla.py; DeepSeek-V2, V3) when kv_lora_rank > 0
    kv_lora_rank: int = 0  # the key/value latent d_c (DeepSeek-V3: 512); 0: no MLA
    q_lora_rank: int = 0  # the query latent d_q (DeepSeek-V3: 1536); 0: one q projection
    qk_nope_head_dim: int = 0  # a head's q/k size without positions (DeepSeek-V3: 128); 0: h/a
    qk_rope_head_dim: int = 0  # its rotary part, one key for all heads (DeepSeek-V3: 64); 0: h/2a
    v_head_dim: int = 0  # a value head's size (DeepSeek-V3: 128); 0: h/a
    # llama: multi-token prediction (mtp.py; DeepSeek-V3: 1 module, lambda 0.3 then 0.1): D extra
    # modules on the last stage, each predicting one token further; their loss x lambda / D
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1

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

    @property
    def dense_ffn(self) -> int:
        """The width of the dense MLPs of an MoE model's first first_k_dense blocks."""
        return self.dense_ffn_hidden or (self.top_k + self.shared_experts) * self.ffn

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` holds experts (every block with n_experts, but the first k)."""
        return bool(self.n_experts) and layer >= self.first_k_dense

    @property
    def mla_dims(self) -> tuple:
        """MLA's head sizes (d_n, d_r, d_v): no-rope and rotary query/key parts, value."""
        hd = self.n_embd // self.n_head
        return (
            self.qk_nope_head_dim or hd,
            self.qk_rope_head_dim or hd // 2,
            self.v_head_dim or hd,
        )

    @property
    def rope_head_dim(self) -> int:
        """The size RoPE rotates: a head (h/a), or MLA's rotary part d_r."""
        return self.mla_dims[1] if self.kv_lora_rank else self.n_embd // self.n_head

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
        if self.arch == "gpt2" and (self.qkv_bias or self.qk_norm or self.qk_norm_whole):
            raise ValueError("--qkv-bias, --qk-norm and --qk-norm-whole are for --arch llama")
        if self.qk_norm and self.qk_norm_whole:
            raise ValueError("--qk-norm (per head, Qwen3) or --qk-norm-whole (OLMoE): one of them")
        if self.rope_type not in ROPE_TYPES or self.rope_original_context < 1:
            raise ValueError(
                f"--rope-type {self.rope_type!r} must be one of {', '.join(ROPE_TYPES)} and "
                f"--rope-original-context {self.rope_original_context} >= 1"
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
        self.validate_mla()
        if self.mtp_num_layers < 0 or self.mtp_num_layers and self.arch != "llama":
            raise ValueError(
                f"--mtp-num-layers {self.mtp_num_layers}: multi-token prediction modules are "
                f"--arch llama blocks (DeepSeek-V3); use 0 (off) or --arch llama"
            )
        if self.arch == "llama" and not self.kv_lora_rank and (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"--arch llama: rotary positions need an even head size, got n_embd/n_head = "
                f"{self.n_embd // self.n_head}"
            )

    def validate_mla(self) -> None:
        """Multi-head latent attention's flags: a Llama attention of its own (no GQA, no q/k/v
        biases, no QK-norm), its sizes >= 0 and set only with --kv-lora-rank, an even rotary part."""
        mla = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        bad = [k for k in mla if getattr(self, k) < 0]
        if bad:
            raise ValueError(
                f"--{bad[0].replace('_', '-')} must be >= 0, got {getattr(self, bad[0])}"
            )
        if not self.kv_lora_rank and any(getattr(self, k) for k in mla):
            raise ValueError(
                "--q-lora-rank, --qk-nope-head-dim, --qk-rope-head-dim and --v-head-dim shape "
                "multi-head latent attention: set --kv-lora-rank > 0 too, or leave them out"
            )
        if self.kv_lora_rank and (
            self.arch != "llama"
            or self.n_kv_head
            or self.qkv_bias
            or self.qk_norm
            or self.qk_norm_whole
        ):
            raise ValueError(
                "--kv-lora-rank (multi-head latent attention) is an --arch llama attention with "
                "its own keys and values: leave out --n-kv-head, --qkv-bias and --qk-norm(-whole)"
            )
        if self.kv_lora_rank and self.mla_dims[1] % 2:
            raise ValueError(
                f"--qk-rope-head-dim {self.mla_dims[1]}: rotary positions need an even size"
            )
        yarn = self.rope_type == "yarn" and self.rope_scaling > 1
        if not 0 <= self.rope_mscale_all_dim < math.inf or (
            self.rope_mscale_all_dim and not (self.kv_lora_rank and yarn)
        ):
            raise ValueError(
                f"--rope-mscale-all-dim {self.rope_mscale_all_dim} (DeepSeek's YaRN) needs "
                "--kv-lora-rank, --rope-type yarn and --rope-scaling > 1, and a finite value >= 0"
            )

    @property
    def mla_score_scale(self) -> float:
        """What DeepSeek's YaRN multiplies every latent-attention score by: mscale(s, m)^2 =
        (0.1 m ln s + 1)^2 (transformers' yarn_apply_mscale); 1 without it."""
        if not self.rope_mscale_all_dim:
            return 1.0
        return (0.1 * self.rope_mscale_all_dim * math.log(self.rope_scaling) + 1.0) ** 2
