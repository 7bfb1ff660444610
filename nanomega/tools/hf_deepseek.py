"""Hugging Face in and out for DeepSeek-V3: nanomega's Llama with latent attention (mla.py), dense
blocks before MoE ones (--first-k-dense) and the deepseek_v3 router <-> transformers'
DeepseekV3ForCausalLM.

A DeepSeek-V3 block is nanomega's Llama block with LatentAttention, and an MLP that is a SwiGLU of
intermediate_size in the first first_k_dense_replace blocks and moe.py's MoE after them (sigmoid
router, group-limited choice on score + e_score_correction_bias, normalized, x
routed_scaling_factor; n_shared_experts ungated shared experts). A model with latent attention and
no experts is the same class with every block dense (first_k_dense_replace = n_layer). The rotary
part: transformers rotates it interleaved (rope_interleave, DeepSeek's released layout) or in
rotate-half (ours); an interleaved folder is imported with the rotary rows of W_qb (W_q) and of
W_kva permuted (interleaved), and exported as rotate-half (rope_interleave false). The balance
loss: DeepSeek-V3's sequence-wise loss (arXiv 2412.19437, eq. 17-20) is alpha sum_i f_i P_i with
f_i = E / (k T) x the assignments of expert i, which is moe.balance_loss's E sum_e f_e P_e: the
coefficient travels unchanged, as DeepSeek's config.json names it (aux_loss_alpha; transformers'
class has no balance loss). What nanomega cannot compute is refused in one line.

    aux loss   alpha (aux_loss_alpha) = moe_aux_loss; absent: the paper's 1e-4 (Sec. 4.2)
    rotary     interleaved row j = rotate-half row (j odd: d_r/2 + j//2, even: j//2) of each head

Multi-token prediction: transformers 5.24's class holds no MTP module; the released checkpoint's
(model.layers.61.*: enorm, hnorm, eh_proj, a decoder block, shared_head.norm; the embedding and
head shared) is skipped on load (_keys_to_ignore_on_load_unexpected). Export writes
num_mtp_layers 0.

Per block i (model.layers.i.; the MoE's names as tools/hf_moe.py's, its router mlp.gate):
    blocks.i.attn.{q_a_proj, q_a_norm, q_b_proj | q_proj}   self_attn.{q_a_proj, q_a_layernorm,
                                                             q_b_proj | q_proj}
    blocks.i.attn.{kv_a_proj, kv_a_norm, kv_b_proj, c_proj}  self_attn.{kv_a_proj_with_mqa,
                                                             kv_a_layernorm, kv_b_proj, o_proj}
    blocks.i.mlp.gate_up / c_proj  (i < k)       mlp.gate_proj, up_proj / down_proj
    blocks.i.mlp.shared.gate_up / c_proj         mlp.shared_experts.gate_proj, up_proj / down_proj
    blocks.i.mlp.expert_bias (E,)                mlp.gate.e_score_correction_bias
Lesson: lessons/14-experts.md
"""

import dataclasses

import torch

from nanomega import moe
from nanomega.gpt_config import GPTConfig
from nanomega.tools.hf_llama import llama_config, llama_name_map
from nanomega.tools.hf_moe import dense_names, expert_tensors, named_tensors, padded, unstacked

# ours -> transformers' names of the latent attention's pieces (self_attn.)
ATTENTION = {
    "q_proj": "q_proj",
    "q_a_proj": "q_a_proj",
    "q_a_norm": "q_a_layernorm",
    "q_b_proj": "q_b_proj",
    "kv_a_proj": "kv_a_proj_with_mqa",
    "kv_a_norm": "kv_a_layernorm",
    "kv_b_proj": "kv_b_proj",
    "c_proj": "o_proj",
}
# transformers normalizes the two latents with this eps whatever rms_norm_eps says
LATENT_EPS = 1e-6
ALPHA = 1e-4  # DeepSeek-V3's balance coefficient (arXiv 2412.19437 Sec. 4.2), where none is given


def interleaved(module, w, cfg, inverse=False):
    """W's rotary rows in DeepSeek's interleaved order (x_0, x_{d/2}, x_1, ...) from our
    rotate-half one (inverse: back): each head's last d_r rows of W_qb (W_q), the last d_r of
    W_kva; any other module's W unchanged."""
    d_n, d_r, _ = cfg.mla_dims
    order = torch.arange(d_r).view(2, -1).t().flatten()  # interleaved row j <- rotate-half row
    order = order.argsort() if inverse else order
    if module in ("q_proj", "q_b_proj"):
        heads = w.view(cfg.n_head, d_n + d_r, -1)
        return torch.cat((heads[:, :d_n], heads[:, d_n:][:, order]), 1).flatten(0, 1)
    if module == "kv_a_proj":
        return torch.cat((w[: cfg.kv_lora_rank], w[cfg.kv_lora_rank :][order]))
    return w


def deepseek_v3_config(c: dict) -> GPTConfig:
    """The GPTConfig of a transformers DeepSeek-V3 config (its dict); what nanomega cannot compute:
    one line."""
    layers, k = c["num_hidden_layers"], c.get("first_k_dense_replace") or 0
    bad = [
        why
        for is_bad, why in [
            (
                not c.get("norm_topk_prob", True),
                "norm_topk_prob false (nanomega's deepseek_v3 normalizes the chosen scores)",
            ),
            (
                c.get("scoring_func", "sigmoid") != "sigmoid"
                or c.get("topk_method", "noaux_tc") != "noaux_tc",
                "scoring_func / topk_method other than sigmoid / noaux_tc (DeepSeek-V3's)",
            ),
            (c.get("moe_layer_freq", 1) != 1, "moe_layer_freq (nanomega: every block after k)"),
            (
                c.get("rms_norm_eps", LATENT_EPS) != LATENT_EPS,
                f"rms_norm_eps {c.get('rms_norm_eps')} (transformers normalizes the latents with "
                f"{LATENT_EPS}; nanomega: one eps)",
            ),
        ]
        if is_bad
    ]
    if bad:
        raise ValueError(
            f"this DeepSeek-V3 differs from nanomega's: {'; '.join(bad)}; it cannot be imported "
            f"exactly"
        )

    # the Llama part (head_dim is d_r there; MLA has no key/value heads), then MLA and the MoE
    moe_blocks = k < layers
    f = c["moe_intermediate_size"] if moe_blocks else c["intermediate_size"]
    base = llama_config({**c, "head_dim": None, "intermediate_size": f})
    mla = dict(
        moe_aux_loss=c.get("aux_loss_alpha", ALPHA),
        n_kv_head=0,
        kv_lora_rank=c["kv_lora_rank"],
        q_lora_rank=c.get("q_lora_rank") or 0,
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
    )
    if not moe_blocks:
        return dataclasses.replace(base, **mla)
    return dataclasses.replace(
        base,
        **mla,
        n_experts=c["n_routed_experts"],
        top_k=c["num_experts_per_tok"],
        router="deepseek_v3",
        n_group=c.get("n_group") or 1,
        topk_group=c.get("topk_group") or 1,
        routed_scaling=float(c.get("routed_scaling_factor", 1.0)),
        shared_experts=c.get("n_shared_experts") or 0,
        first_k_dense=k,
        dense_ffn_hidden=c["intermediate_size"] if k else 0,
    )


def check(cfg: GPTConfig):
    """One line for a latent-attention model transformers' DeepseekV3ForCausalLM cannot hold."""
    if cfg.n_experts and moe.rule(cfg.router) != "deepseek_v3":
        raise ValueError("DeepSeek-V3 routes with --router deepseek_v3: train with it to export")
    if cfg.shared_expert_gate or cfg.capacity_factor:
        raise ValueError(
            "DeepSeek-V3 has no --shared-expert-gate and drops no token (--capacity-factor)"
        )
    if cfg.norm_eps != LATENT_EPS or cfg.rope_scaling != 1.0:
        raise ValueError(
            f"DeepSeek-V3's transformers class normalizes the latents with eps {LATENT_EPS} and "
            f"its RoPE scaling rescales the attention: train with --norm-eps {LATENT_EPS} and "
            "without --rope-scaling to export"
        )


def names(cfg: GPTConfig):
    """{nanomega name: (transformers names)} of every weight but the stacked experts (routing
    biases included)."""
    out = {
        k: v for k, v in dense_names(cfg.n_layer, cfg.tie_embeddings).items() if ".attn." not in k
    }
    mlp = {k: v for k, v in llama_name_map(cfg.n_layer).items() if ".mlp." in k}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for mine, name in ATTENTION.items():
            if mine not in ("q_proj", "q_a_proj", "q_a_norm", "q_b_proj") or (
                (mine == "q_proj") != bool(cfg.q_lora_rank)
            ):
                out[f"{ours}attn.{mine}.weight"] = (f"{theirs}self_attn.{name}.weight",)
        if not cfg.is_moe(i):
            out |= {k: v for k, v in mlp.items() if k.startswith(ours)}
            continue
        out[ours + "mlp.router.weight"] = (theirs + "mlp.gate.weight",)
        out[ours + "mlp.expert_bias"] = (theirs + "mlp.gate.e_score_correction_bias",)
        if cfg.shared_experts:
            out[ours + "mlp.shared.gate_up.weight"] = tuple(
                f"{theirs}mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up")
            )
            out[ours + "mlp.shared.c_proj.weight"] = (
                f"{theirs}mlp.shared_experts.down_proj.weight",
            )
    return out


def hf_model(cfg: GPTConfig):
    """(transformers DeepseekV3Config, DeepseekV3ForCausalLM, names(cfg)) of a latent-attention
    Llama (rotate-half rotary rows: rope_interleave false)."""
    import transformers

    check(cfg)
    v, (d_n, d_r, d_v) = cfg.vocab_size, cfg.mla_dims
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=v,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.dense_ffn if cfg.n_experts else cfg.ffn,
        moe_intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head,
        n_shared_experts=cfg.shared_experts,
        n_routed_experts=cfg.n_experts or 2,  # unused without MoE blocks
        routed_scaling_factor=cfg.routed_scaling,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        num_experts_per_tok=cfg.top_k,
        first_k_dense_replace=cfg.first_k_dense if cfg.n_experts else cfg.n_layer,
        norm_topk_prob=True,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None,
        qk_nope_head_dim=d_n,
        qk_rope_head_dim=d_r,
        v_head_dim=d_v,
        max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        rope_interleave=False,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        num_mtp_layers=0,
        aux_loss_alpha=cfg.moe_aux_loss,  # DeepSeek's own config.json key (module docstring)
        seq_aux=True,
        bos_token_id=v - 1,
        eos_token_id=v - 1,
    )
    hf_cfg.architectures = ["DeepseekV3ForCausalLM"]
    return hf_cfg, transformers.DeepseekV3ForCausalLM, names(cfg)


def hf_tensors(cfg: GPTConfig):
    """[(transformers name, [nanomega names], make)] of a DeepSeek-V3 (hf_weights.hf_tensors)."""
    return named_tensors(names(cfg), cfg.vocab_size) + expert_tensors(
        cfg, filter(cfg.is_moe, range(cfg.n_layer))
    )


def from_hf(model):
    """(GPTConfig, nanomega full weights and routing biases) from a transformers
    DeepseekV3ForCausalLM; an interleaved one's rotary rows permuted to rotate-half."""
    cfg = deepseek_v3_config(model.config.to_dict())
    theirs = {k: t.detach().float() for k, t in model.state_dict().items()}
    weights = {ours: torch.cat([theirs[n] for n in hf]) for ours, hf in names(cfg).items()}
    if model.config.rope_interleave:
        for name in weights:
            module = name.split(".")[-2]
            if ".attn." in name:
                weights[name] = interleaved(module, weights[name], cfg, inverse=True)

    experts = unstacked(theirs, cfg, filter(cfg.is_moe, range(cfg.n_layer)))
    return cfg, padded(weights | experts, cfg)
