"""The model's flags: its shape (gpt_config.GPTConfig takes the fields declared model=True), latent
attention, multi-token prediction and the mixture of experts. One field per flag (job/section.py).
Lesson: lessons/02-modern-block.md
"""

import dataclasses

from nanomega.job.ranges import above, at_least
from nanomega.job.section import EXPERTS, MODEL


@dataclasses.dataclass(frozen=True)
class ModelFlags:
    """The model's shape, or a preset's; MLA, MTP and the experts."""

    # the model's shape (gpt_config.GPTConfig), or a preset's
    model: str | None = MODEL(
        None,
        "a preset shape from nanomega/job/presets.py (gpt2-124m, ...); shape flags given explicitly "
        "override it; the vocabulary stays the tokenizer's",
    )
    n_layer: int = MODEL(4, "transformer blocks", at_least(1), model=True)
    n_head: int = MODEL(4, "attention heads", at_least(1), model=True)
    n_embd: int = MODEL(128, "hidden size h", at_least(1), model=True)
    block_size: int = MODEL(128, "sequence length s (tokens per window)", at_least(1), model=True)
    dropout: float = MODEL(
        0.0, "dropout probability (0: off)", (lambda v, c: 0 <= v < 1, "in [0, 1)"), model=True
    )
    alibi: bool = MODEL(False, "ALiBi attention biases instead of learned positions", model=True)
    embed_layernorm: bool = MODEL(False, "LayerNorm after the embedding (BLOOM)", model=True)
    arch: str = MODEL(
        "gpt2",
        "gpt2 (LayerNorm, GeLU, learned positions) or llama (RMSNorm, SwiGLU, rotary positions, "
        "no biases: nanomega/modern.py)",
        model=True,
    )
    n_kv_head: int = MODEL(
        0, "llama: key/value heads (grouped-query); 0: --n-head", at_least(0), model=True
    )
    ffn_hidden: int = MODEL(
        0, "llama: MLP width; 0: 2/3 x 4h up to a multiple of 256", at_least(0), model=True
    )
    rope_theta: float = MODEL(10000.0, "llama: rotary base (Llama 3: 500000)", above(0), model=True)
    rope_scaling: float = MODEL(
        1.0,
        "llama: RoPE's frequency scaling factor (Llama 3.1: 8)",
        above(0, " (1: no scaling)"),
        model=True,
    )
    rope_type: str = MODEL(
        "llama3", "llama: --rope-scaling's rule: llama3, linear, dynamic or yarn", model=True
    )
    rope_original_context: int = MODEL(
        8192, "llama: the pretraining context of --rope-scaling", at_least(1), model=True
    )
    rope_mscale_all_dim: float = MODEL(
        0.0,
        "MLA with --rope-type yarn: DeepSeek's mscale_all_dim (scores x mscale^2; 0: off)",
        at_least(0),
        model=True,
    )
    qkv_bias: bool = MODEL(False, "llama: biases on q, k and v (Qwen2)", model=True)
    qk_norm: bool = MODEL(False, "llama: RMSNorm on each head of q and k (Qwen3)", model=True)
    qk_norm_whole: bool = MODEL(
        False, "llama: RMSNorm over the whole q and k projections (OLMoE; --tp 1)", model=True
    )
    tie_embeddings: bool = MODEL(
        True,
        "llama: an LM head of its own instead of the token embedding",
        model=True,
        names=("--untie-embeddings",),
        action="store_false",
    )
    norm_eps: float = MODEL(1e-5, "epsilon of every LayerNorm / RMSNorm", above(0), model=True)
    # multi-head latent attention (nanomega/mla.py; DeepSeek-V2, V3)
    kv_lora_rank: int = MODEL(
        0,
        "llama: latent attention's key/value latent (DeepSeek-V3: 512; 0: off)",
        at_least(0),
        model=True,
    )
    q_lora_rank: int = MODEL(
        0, "MLA: the query latent (DeepSeek-V3: 1536; 0: one q projection)", at_least(0), model=True
    )
    qk_nope_head_dim: int = MODEL(
        0,
        "MLA: a head's q/k size without positions (DeepSeek-V3: 128; 0: h/a)",
        at_least(0),
        model=True,
    )
    qk_rope_head_dim: int = MODEL(
        0,
        "MLA: its rotary part, one key for all heads (DeepSeek-V3: 64; 0: h/2a)",
        at_least(0),
        model=True,
    )
    v_head_dim: int = MODEL(
        0, "MLA: a value head's size (DeepSeek-V3: 128; 0: h/a)", at_least(0), model=True
    )
    # multi-token prediction (nanomega/mtp.py; DeepSeek-V3; Megatron-Core's flag names)
    mtp_num_layers: int = MODEL(
        0,
        "llama: multi-token prediction modules D on the last stage (DeepSeek-V3: 1; 0: off)",
        at_least(0),
        model=True,
    )
    mtp_loss_scaling_factor: float = MODEL(
        0.1,
        "the MTP loss's weight lambda: lambda / D x the depths' losses (DeepSeek-V3: 0.3, then 0.1)",
        at_least(0),
        model=True,
    )

    # mixture of experts: the router and the experts (moe.py)
    n_experts: int = EXPERTS(
        0, "routed SwiGLU experts per block (0: dense MLPs)", at_least(0), model=True
    )
    top_k: int = EXPERTS(2, "experts per token", at_least(1), model=True)
    router: str = EXPERTS(
        "mixtral",
        "mixtral (top-k of the logits, softmax over k), softmax_topk (softmax over all, top-k: "
        "DeepSeek-V2, Qwen2-MoE, OLMoE), softmax_topk_norm (the same renormalized: Qwen3-MoE) or "
        "deepseek_v3 (sigmoid, group-limited, normalized, scaled); moe.ROUTERS",
        model=True,
    )
    n_group: int = EXPERTS(
        1, "deepseek_v3: expert groups (nodes; DeepSeek-V3: 8)", at_least(1), model=True
    )
    topk_group: int = EXPERTS(
        1, "deepseek_v3: groups one token may use (DeepSeek-V3: 4)", at_least(1), model=True
    )
    routed_scaling: float = EXPERTS(
        1.0, "deepseek_v3: routed weights x this (DeepSeek-V3: 2.5)", above(0), model=True
    )
    moe_aux_loss: float = EXPERTS(
        0.01, "load-balancing loss coefficient (Switch)", at_least(0), model=True
    )
    moe_z_loss: float = EXPERTS(0.0, "router z-loss coefficient (ST-MoE)", at_least(0), model=True)
    capacity_factor: float = EXPERTS(
        0.0,
        "assignments per expert and sequence <= ceil(cf s k / E), the rest dropped (0: dropless)",
        at_least(0),
        model=True,
    )
    shared_experts: int = EXPERTS(
        0, "experts every token also runs through", at_least(0), model=True
    )
    shared_expert_gate: bool = EXPERTS(
        False, "Qwen2-MoE: the shared experts' output x sigmoid(x . w_gate)", model=True
    )
    first_k_dense: int = EXPERTS(
        0,
        "the first k blocks keep a dense SwiGLU, the rest are MoE (DeepSeek-V3's "
        "first_k_dense_replace: 3)",
        at_least(0),
        model=True,
    )
    dense_ffn_hidden: int = EXPERTS(
        0,
        "the width of those dense blocks' MLP (0: (top_k + shared_experts) x ffn; DeepSeek-V3: "
        "18432)",
        at_least(0),
        model=True,
    )
    moe_bias_balance: float = EXPERTS(
        0.0,
        "DeepSeek-V3's auxiliary-loss-free balancing: the routing bias's step per optimizer step "
        "(0: off; DeepSeek-V3: 0.001)",
        at_least(0),
    )
