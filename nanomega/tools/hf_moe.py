"""Hugging Face in and out for the MoE Llama: nanomega <-> a transformers `MixtralForCausalLM`.

Mixtral is a Llama whose MLP is moe.py's block with router="mixtral" (softmax over the E logits,
top-k, the k weights renormalized: the same weights as a softmax over the top-k logits), no shared
experts, no capacity. Everything outside the MLP maps as hf.py's Llama; `python -m nanomega.tools.hf
import / export` reads and writes a Mixtral folder through this module. What nanomega cannot compute
is refused (see the lesson); the aux loss coefficient travels as router_aux_loss_coef.

Per block i (transformers 5 stacks the experts; gate_up is [gate; up] on both sides):
    blocks.i.mlp.router.weight             (E, h)   model.layers.i.mlp.gate.weight
    blocks.i.mlp.experts.e.gate_up.weight  (2f, h)  model.layers.i.mlp.experts.gate_up_proj[e]
    blocks.i.mlp.experts.e.c_proj.weight   (h, f)   model.layers.i.mlp.experts.down_proj[e]
Lesson: lessons/14-experts.md
"""

import dataclasses
import functools

import torch

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
        moe_aux_loss=c.get("router_aux_loss_coef", 0.001),
    )


def dense_names(n_layer, tied):
    """hf.py's Llama names without the MLP's (Mixtral's MLP is the experts)."""
    return {k: v for k, v in llama_name_map(n_layer, tied).items() if ".mlp." not in k}


def check(cfg: GPTConfig, bias=None):
    """One line for an MoE model a Mixtral cannot hold; bias: the checkpoint's (n_layer,
    E) routing biases."""
    if cfg.router != "mixtral" or cfg.shared_experts or cfg.capacity_factor:
        raise ValueError(
            "Mixtral routes with --router mixtral, no --shared-experts, no --capacity-factor"
        )
    if bias is not None and bias.abs().sum() > 0:
        raise ValueError(
            "this checkpoint routes with --moe-bias-balance's biases (DeepSeek-V3), which a Mixtral "
            "has no field for: its export would route otherwise; train without --moe-bias-balance"
        )


def hf_model(cfg: GPTConfig):
    """(transformers MixtralConfig, MixtralForCausalLM, {nanomega name: (transformers names)} of
    everything but the experts) of an MoE Llama."""
    import transformers

    check(cfg)
    v = cfg.vocab_size
    hf_cfg = transformers.MixtralConfig(
        vocab_size=v,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.n_embd // cfg.n_head,
        max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=cfg.moe_aux_loss,
        sliding_window=None,
        bos_token_id=v - 1,
        eos_token_id=v - 1,
    )
    hf_cfg.architectures = ["MixtralForCausalLM"]
    return hf_cfg, transformers.MixtralForCausalLM, dense_names(cfg.n_layer, cfg.tie_embeddings)


def _part(i, k, padded, v, tensors):
    """Part i of k of one nanomega tensor (its first v rows when padded), in its own memory."""
    t = tensors[0].float()
    return (t[:v] if padded else t).chunk(k)[i].clone(memory_format=torch.contiguous_format)


def _stacked(tensors):
    """The experts' tensors of one layer stacked, (E, ...) (transformers 5's layout)."""
    return torch.stack([t.float() for t in tensors])


def hf_tensors(cfg: GPTConfig):
    """[(transformers name, [nanomega names], make)] of a Mixtral (hf_weights.hf_tensors)."""
    v, out = cfg.vocab_size, []
    for ours, theirs in hf_model(cfg)[2].items():
        padded = ours in ("embed.wte.weight", "head.lm_head.weight")
        for i, name in enumerate(theirs):
            out.append((name, [ours], functools.partial(_part, i, len(theirs), padded, v)))
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        out.append(
            (
                theirs + "gate.weight",
                [ours + "router.weight"],
                functools.partial(_part, 0, 1, False, v),
            )
        )
        for mine, name in (("gate_up", "gate_up_proj"), ("c_proj", "down_proj")):
            experts = [f"{ours}experts.{e}.{mine}.weight" for e in range(cfg.n_experts)]
            out.append((theirs + "experts." + name, experts, _stacked))
    return out


def from_hf(model):
    """(GPTConfig, nanomega full weights) from a transformers MixtralForCausalLM."""
    cfg = mixtral_config(model.config.to_dict())
    theirs = {k: t.detach().float() for k, t in model.state_dict().items()}
    weights = {
        ours: torch.cat([theirs[n] for n in names])
        for ours, names in dense_names(cfg.n_layer, cfg.tie_embeddings).items()
    }

    # each layer's router and experts
    for i in range(cfg.n_layer):
        ours, hf = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        weights[ours + "router.weight"] = theirs[hf + "gate.weight"].clone()
        for e in range(cfg.n_experts):
            weights[f"{ours}experts.{e}.gate_up.weight"] = theirs[hf + "experts.gate_up_proj"][
                e
            ].clone()
            weights[f"{ours}experts.{e}.c_proj.weight"] = theirs[hf + "experts.down_proj"][
                e
            ].clone()

    # zero rows so tp can split V (hf.py does the same)
    pad = cfg.padded_vocab_size - cfg.vocab_size
    for name in ("embed.wte.weight", "head.lm_head.weight"):
        if name in weights:
            weights[name] = torch.cat([weights[name], weights[name].new_zeros(pad, cfg.n_embd)])
    return cfg, weights
