"""Hugging Face in and out for the MoE Llama: nanomega <-> a transformers `MixtralForCausalLM`,
`Qwen2MoeForCausalLM` or `Qwen3MoeForCausalLM`.

Mixtral is a Llama whose MLP is moe.py's block with router="mixtral" (softmax over the E logits,
top-k, the k weights renormalized: the same weights as a softmax over the top-k logits), no shared
experts, no capacity. Qwen2-MoE (qkv_bias false, every layer MoE) is the same block routed by
softmax_topk (norm_topk_prob false) or softmax_topk_norm (true), plus shared experts times a sigmoid
gate (--shared-expert-gate): a model with the gate exports as Qwen2-MoE, one without as Mixtral.
Qwen3-MoE is Qwen3's block (--qk-norm: RMSNorm over each head of q and k) with the same routers, no
shared experts, and its mlp_only_layers [0 .. k-1] as --first-k-dense k (their width
intermediate_size: --dense-ffn-hidden); a model with --qk-norm exports as Qwen3-MoE. OLMoE is a
Llama with RMSNorm over the whole q and k projections (--qk-norm-whole), no shared experts, routed
by softmax_topk (norm_topk_prob false) or softmax_topk_norm.
Everything outside the MLP maps as hf.py's Llama; `python -m nanomega.tools.hf import / export`
reads and writes a Mixtral folder through this module. What nanomega cannot compute is refused (see
the lesson); the aux loss coefficient travels as router_aux_loss_coef, converted
(transformers' load_balancing_loss_func divides the assignments by the tokens, shares summing to k;
moe.balance_loss by the assignments, shares summing to 1):

    aux loss   transformers' = k x ours, so router_aux_loss_coef = moe_aux_loss / k

Per block i (transformers 5 stacks the experts; gate_up is [gate; up] on both sides):
    blocks.i.mlp.router.weight             (E, h)   model.layers.i.mlp.gate.weight
    blocks.i.mlp.experts.e.gate_up.weight  (2f, h)  model.layers.i.mlp.experts.gate_up_proj[e]
    blocks.i.mlp.experts.e.c_proj.weight   (h, f)   model.layers.i.mlp.experts.down_proj[e]
    blocks.i.mlp.shared.gate_up.weight   (2nf, h)   mlp.shared_expert.gate_proj, up_proj (Qwen2-MoE)
    blocks.i.mlp.shared.c_proj.weight     (h, nf)   mlp.shared_expert.down_proj
    blocks.i.mlp.shared_gate.weight        (1, h)   mlp.shared_expert_gate.weight
Lesson: lessons/16-experts.md
"""

import dataclasses
import functools

import torch

from nanomega import moe
from nanomega.gpt_config import GPTConfig
from nanomega.tools.hf_llama import llama_config, llama_name_map


def mixtral_config(c: dict) -> GPTConfig:
    """The GPTConfig of a transformers Mixtral config (its dict); what nanomega cannot
    compute: one line."""
    bad = [
        why
        for is_bad, why in [
            (
                c.get("sliding_window"),
                f"sliding_window {c.get('sliding_window')} (nanomega: full causal attention)",
            ),
            (c.get("router_jitter_noise"), "router_jitter_noise (nanomega: none)"),
        ]
        if is_bad
    ]

    if bad:
        raise ValueError(
            f"this Mixtral differs from nanomega's: {'; '.join(bad)}; it cannot be imported exactly"
        )

    return dataclasses.replace(
        llama_config(c),
        n_experts=c["num_local_experts"],
        top_k=c["num_experts_per_tok"],
        router="mixtral",
        moe_aux_loss=c.get("router_aux_loss_coef", 0.001) * c["num_experts_per_tok"],
    )


def qwen2_moe_config(c: dict) -> GPTConfig:
    """The GPTConfig of a transformers Qwen2-MoE config (its dict); what nanomega cannot
    compute: one line."""
    f, shared = c["moe_intermediate_size"], c.get("shared_expert_intermediate_size", 0)
    bad = [
        why
        for is_bad, why in [
            (c.get("qkv_bias", True), "qkv_bias true (nanomega's Llama has no attention biases)"),
            (c.get("use_sliding_window"), "use_sliding_window (nanomega: full causal attention)"),
            (
                c.get("decoder_sparse_step", 1) != 1 or c.get("mlp_only_layers"),
                "dense layers (decoder_sparse_step, mlp_only_layers; nanomega: every layer MoE)",
            ),
            (
                not shared or shared % f,
                f"shared_expert_intermediate_size {shared} (nanomega: a multiple >= 1 of "
                f"moe_intermediate_size {f})",
            ),
        ]
        if is_bad
    ]
    if bad:
        raise ValueError(
            f"this Qwen2-MoE differs from nanomega's: {'; '.join(bad)}; it cannot be imported exactly"
        )

    k = c["num_experts_per_tok"]
    return dataclasses.replace(
        llama_config({**c, "intermediate_size": f}),
        n_experts=c["num_experts"],
        top_k=k,
        router="softmax_topk_norm" if c.get("norm_topk_prob") else "softmax_topk",
        shared_experts=shared // f,
        shared_expert_gate=True,
        moe_aux_loss=c.get("router_aux_loss_coef", 0.001) * k,
    )


def qwen3_moe_config(c: dict) -> GPTConfig:
    """The GPTConfig of a transformers Qwen3-MoE config (its dict): a Qwen3 (QK-norm per head)
    whose MLPs are experts, but the first k when mlp_only_layers is [0 .. k-1] (--first-k-dense);
    what nanomega cannot compute: one line."""
    dense, k = c.get("mlp_only_layers") or [], len(c.get("mlp_only_layers") or [])
    # the Hub's config.json says num_experts; transformers 5 writes num_local_experts
    experts = c.get("num_experts") or c.get("num_local_experts")
    if not experts:
        raise ValueError("no num_experts (nor num_local_experts): not a Qwen3-MoE config")
    if c.get("decoder_sparse_step", 1) != 1 or dense != list(range(k)):
        raise ValueError(
            f"this Qwen3-MoE differs from nanomega's: dense layers {dense} every "
            f"{c.get('decoder_sparse_step')} (decoder_sparse_step, mlp_only_layers; nanomega: the "
            "first k, then every layer MoE); it cannot be imported exactly"
        )
    top = c["num_experts_per_tok"]
    return dataclasses.replace(
        llama_config({**c, "intermediate_size": c["moe_intermediate_size"]}, "qwen3"),
        n_experts=experts,
        top_k=top,
        router="softmax_topk_norm" if c.get("norm_topk_prob") else "softmax_topk",
        first_k_dense=k,
        dense_ffn_hidden=c["intermediate_size"] if k else 0,
        moe_aux_loss=c.get("router_aux_loss_coef", 0.001) * top,
    )


def olmoe_config(c: dict) -> GPTConfig:
    """The GPTConfig of a transformers OLMoE config (its dict): a Llama with QK-norm over the whole
    q and k projections (--qk-norm-whole) whose MLPs are experts; what nanomega cannot compute:
    one line."""
    if c.get("clip_qkv") is not None:
        raise ValueError(
            f"this OLMoE differs from nanomega's: clip_qkv {c['clip_qkv']} (nanomega: none); it "
            "cannot be imported exactly"
        )
    top = c["num_experts_per_tok"]
    return dataclasses.replace(
        llama_config(c, "olmoe"),
        qk_norm_whole=True,
        n_experts=c["num_experts"],
        top_k=top,
        router="softmax_topk_norm" if c.get("norm_topk_prob") else "softmax_topk",
        moe_aux_loss=c.get("router_aux_loss_coef", 0.01) * top,
    )


# model_type -> its config read as a GPTConfig
CONFIGS = dict(
    mixtral=mixtral_config,
    qwen2_moe=qwen2_moe_config,
    qwen3_moe=qwen3_moe_config,
    olmoe=olmoe_config,
)
# nanomega name -> Qwen2-MoE's names of the shared experts and their gate, per block (.mlp.)
SHARED = {
    "shared.gate_up.weight": ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight"),
    "shared.c_proj.weight": ("shared_expert.down_proj.weight",),
    "shared_gate.weight": ("shared_expert_gate.weight",),
}


def family(cfg: GPTConfig):
    """The transformers model_type an MoE Llama exports as: qwen2_moe with the shared gate,
    qwen3_moe with QK-norm per head, olmoe with it over the whole projections, else mixtral."""
    if cfg.qk_norm_whole:
        return "olmoe"
    return "qwen2_moe" if cfg.shared_expert_gate else "qwen3_moe" if cfg.qk_norm else "mixtral"


def moe_names(cfg: GPTConfig):
    """{nanomega name: (transformers names)} of every weight but the stacked experts (the dense
    blocks' MLPs: Llama's names)."""
    qk_norm = cfg.qk_norm or cfg.qk_norm_whole  # Qwen3-MoE's and OLMoE's: the same names
    names = llama_name_map(cfg.n_layer, cfg.tie_embeddings, qk_norm=qk_norm)
    names = {
        k: v for k, v in names.items() if ".mlp." not in k or not cfg.is_moe(int(k.split(".")[1]))
    }
    for i in filter(cfg.is_moe, range(cfg.n_layer)):
        ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        names[ours + "router.weight"] = (theirs + "gate.weight",)
        if family(cfg) == "qwen2_moe":
            names |= {ours + a: tuple(theirs + n for n in b) for a, b in SHARED.items()}
    return names


def dense_names(n_layer, tied):
    """hf.py's Llama names without the MLP's (Mixtral's MLP is the experts)."""
    return {k: v for k, v in llama_name_map(n_layer, tied).items() if ".mlp." not in k}


def check(cfg: GPTConfig, bias=None):
    """One line for an MoE model no Mixtral, Qwen2-MoE or Qwen3-MoE can hold; bias: the
    checkpoint's (n_layer, E) routing biases."""
    if family(cfg) == "mixtral" and (cfg.router != "mixtral" or cfg.shared_experts):
        raise ValueError(
            "Mixtral routes with --router mixtral and no --shared-experts; Qwen2-MoE with "
            "softmax_topk or softmax_topk_norm and --shared-experts with --shared-expert-gate"
        )
    if family(cfg) != "mixtral" and moe.rule(cfg.router) not in QWEN_ROUTERS:
        raise ValueError(f"Qwen-MoE and OLMoE route with --router {' or '.join(QWEN_ROUTERS)}")
    if (family(cfg) in ("qwen3_moe", "olmoe") and cfg.shared_experts) or (
        family(cfg) != "qwen3_moe" and cfg.first_k_dense
    ):
        raise ValueError(
            "Qwen3-MoE (--qk-norm) and OLMoE (--qk-norm-whole) have no shared experts; Mixtral, "
            "Qwen2-MoE and OLMoE no dense blocks (--first-k-dense): train without them to export"
        )
    if cfg.capacity_factor:
        raise ValueError("transformers' MoE models drop no token: train without --capacity-factor")
    if bias is not None and bias.abs().sum() > 0:
        raise ValueError(
            "this checkpoint routes with --moe-bias-balance's biases (DeepSeek-V3), which a Mixtral "
            "or Qwen2-MoE has no field for: its export would route otherwise; train without "
            "--moe-bias-balance"
        )


QWEN_ROUTERS = ("softmax_topk", "softmax_topk_norm")  # norm_topk_prob false, true


def hf_model(cfg: GPTConfig):
    """(transformers config, model class, {nanomega name: (transformers names)} of every weight but
    the stacked experts) of an MoE Llama: Mixtral, Qwen2-MoE with --shared-expert-gate, Qwen3-MoE
    with --qk-norm."""
    import transformers

    check(cfg)
    v = cfg.vocab_size
    common = dict(
        vocab_size=v,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=cfg.moe_aux_loss / cfg.top_k,
        bos_token_id=v - 1,
        eos_token_id=v - 1,
    )
    if family(cfg) == "mixtral":
        hf_cfg, model_class = (
            transformers.MixtralConfig(
                head_dim=cfg.n_embd // cfg.n_head,
                num_local_experts=cfg.n_experts,
                sliding_window=None,
                **common,
            ),
            transformers.MixtralForCausalLM,
        )
    elif family(cfg) == "qwen2_moe":
        hf_cfg, model_class = (
            transformers.Qwen2MoeConfig(
                moe_intermediate_size=cfg.ffn,
                shared_expert_intermediate_size=cfg.ffn * cfg.shared_experts,
                num_experts=cfg.n_experts,
                norm_topk_prob=moe.rule(cfg.router) == "softmax_topk_norm",
                qkv_bias=False,
                use_sliding_window=False,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                **common,
            ),
            transformers.Qwen2MoeForCausalLM,
        )
    elif family(cfg) == "olmoe":
        hf_cfg, model_class = (
            transformers.OlmoeConfig(
                num_experts=cfg.n_experts,
                norm_topk_prob=moe.rule(cfg.router) == "softmax_topk_norm",
                attention_bias=False,
                clip_qkv=None,
                pad_token_id=None,
                **common,
            ),
            transformers.OlmoeForCausalLM,
        )
    else:  # Qwen3-MoE: the first first_k_dense blocks dense (mlp_only_layers), of their width
        common["intermediate_size"] = cfg.dense_ffn if cfg.first_k_dense else cfg.ffn
        hf_cfg, model_class = (
            transformers.Qwen3MoeConfig(
                head_dim=cfg.n_embd // cfg.n_head,
                moe_intermediate_size=cfg.ffn,
                num_experts=cfg.n_experts,
                norm_topk_prob=moe.rule(cfg.router) == "softmax_topk_norm",
                attention_bias=False,
                use_sliding_window=False,
                decoder_sparse_step=1,
                mlp_only_layers=list(range(cfg.first_k_dense)),
                **common,
            ),
            transformers.Qwen3MoeForCausalLM,
        )
    hf_cfg.architectures = [model_class.__name__]
    return hf_cfg, model_class, moe_names(cfg)


def part(i, k, padded, v, tensors):
    """Part i of k of one nanomega tensor (its first v rows when padded), in its own memory."""
    t = tensors[0].float()
    return (t[:v] if padded else t).chunk(k)[i].clone(memory_format=torch.contiguous_format)


def stacked(tensors):
    """The experts' tensors of one layer stacked, (E, ...) (transformers 5's layout)."""
    return torch.stack([t.float() for t in tensors])


def named_tensors(names, v):
    """[(transformers name, [nanomega name], make)] of a {nanomega name: (transformers names)}
    map: each transformers tensor a part of one of ours (the embedding and head cut to v rows)."""
    out = []
    for ours, theirs in names.items():
        padded = ours in ("embed.wte.weight", "head.lm_head.weight")
        for i, name in enumerate(theirs):
            out.append((name, [ours], functools.partial(part, i, len(theirs), padded, v)))
    return out


def expert_tensors(cfg: GPTConfig, layers):
    """[(transformers name, [nanomega names], make)] of the experts of `layers`, stacked."""
    out = []
    for i in layers:
        ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        for mine, name in (("gate_up", "gate_up_proj"), ("c_proj", "down_proj")):
            experts = [f"{ours}experts.{e}.{mine}.weight" for e in range(cfg.n_experts)]
            out.append((theirs + "experts." + name, experts, stacked))
    return out


def hf_tensors(cfg: GPTConfig):
    """[(transformers name, [nanomega names], make)] of a Mixtral or Qwen2-MoE
    (hf_weights.hf_tensors): every named weight (the router and the shared experts included),
    then each layer's experts stacked."""
    return named_tensors(hf_model(cfg)[2], cfg.vocab_size) + expert_tensors(
        cfg, filter(cfg.is_moe, range(cfg.n_layer))
    )


def unstacked(theirs, cfg: GPTConfig, layers):
    """{nanomega name: tensor} of the experts of `layers` from transformers' stacked tensors."""
    out = {}
    for i in layers:
        ours, hf = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        for e in range(cfg.n_experts):
            for mine, name in (("gate_up", "gate_up_proj"), ("c_proj", "down_proj")):
                out[f"{ours}experts.{e}.{mine}.weight"] = theirs[f"{hf}experts.{name}"][e].clone()
    return out


def padded(weights, cfg: GPTConfig):
    """The embedding and an untied head with zero rows up to the padded vocabulary, so tp can
    split V (hf.py does the same)."""
    pad = cfg.padded_vocab_size - cfg.vocab_size
    for name in ("embed.wte.weight", "head.lm_head.weight"):
        if name in weights:
            weights[name] = torch.cat([weights[name], weights[name].new_zeros(pad, cfg.n_embd)])
    return weights


def from_hf(model):
    """(GPTConfig, nanomega full weights) from a transformers MixtralForCausalLM,
    Qwen2MoeForCausalLM or Qwen3MoeForCausalLM."""
    cfg = CONFIGS[model.config.model_type](model.config.to_dict())
    theirs = {k: t.detach().float() for k, t in model.state_dict().items()}
    weights = {
        ours: torch.cat([theirs[n] for n in names]) for ours, names in moe_names(cfg).items()
    }
    experts = unstacked(theirs, cfg, filter(cfg.is_moe, range(cfg.n_layer)))
    return cfg, padded(weights | experts, cfg)
