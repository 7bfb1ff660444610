"""nanomega's full weights <-> a transformers model in memory: GPT-2's names here.

Idea: nanomega's dense GPT is GPT-2 and, with arch="llama", Llama, up to names and a few details:
    GPT-2  transformers' Conv1D weight is the transpose of nn.Linear's: W_hf = W^T (in, out)
    Llama  kv_proj = [k_proj; v_proj], gate_up = [gate_proj; up_proj], by rows (tools/hf_llama.py)
    vocab  nanomega pads V; export keeps the first V rows, import appends zero rows
Mixtral (a Llama whose MLP is experts) is tools/hf_moe.py, DeepSeek-V3 (latent attention)
tools/hf_deepseek.py; folders and the CLI are tools/hf.py.
Lesson: lessons/02-the-modern-block.md
"""

import functools

import torch

from nanomega.gpt_config import GPTConfig
from nanomega.tools import hf_deepseek, hf_moe
from nanomega.tools.hf_llama import DENSE, hf_rope, llama_config, llama_name_map

# nanomega name -> transformers GPT2LMHeadModel name, per block ({i}); Conv1D weights are transposed
_BLOCK = {
    k: k
    for k in (
        "ln_1.weight",
        "ln_1.bias",
        "ln_2.weight",
        "ln_2.bias",
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "attn.c_proj.weight",
        "attn.c_proj.bias",
        "mlp.c_fc.weight",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    )
} | {"mlp.fc_bias": "mlp.c_fc.bias"}
_TOP = {
    "embed.wte.weight": "transformer.wte.weight",
    "embed.wpe.weight": "transformer.wpe.weight",
    "head.ln_f.weight": "transformer.ln_f.weight",
    "head.ln_f.bias": "transformer.ln_f.bias",
}
_CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
_PADDED = ("embed.wte.weight", "head.lm_head.weight")  # (V padded, h) here, (V, h) in transformers


def require_transformers():
    """The transformers module, or one line naming the extra to install."""
    try:
        import safetensors  # noqa: F401  (save_pretrained writes model.safetensors with it)
        import transformers
    except ImportError:
        raise ValueError(
            "nanomega.tools.hf needs transformers and safetensors: pip install 'nanomega[hf]'"
        ) from None
    return transformers


def name_map(n_layer):
    """{nanomega parameter name: transformers name} for a GPT of n_layer blocks."""
    names = dict(_TOP)
    for i in range(n_layer):
        names.update({f"blocks.{i}.{a}": f"transformer.h.{i}.{b}" for a, b in _BLOCK.items()})
    return names


def check_gpt2(cfg: GPTConfig):
    if cfg.alibi or cfg.embed_layernorm:
        what = "ALiBi attention" if cfg.alibi else "an embedding LayerNorm"
        raise ValueError(
            f"this model has {what} (BLOOM-style), which GPT-2 does not: it cannot be exported "
            f"as a GPT2LMHeadModel; train without --alibi/--embed-layernorm to export"
        )


def hf_model(cfg: GPTConfig):
    """(transformers config, model class, {nanomega name: (transformers names)}) of cfg:
    GPT2LMHeadModel, or (cfg.arch llama) LlamaForCausalLM, Qwen2ForCausalLM (qkv_bias) or
    Qwen3ForCausalLM (qk_norm); MixtralForCausalLM with experts (its MLP's names: hf_moe.py)."""
    transformers = require_transformers()
    v = cfg.vocab_size
    if cfg.kv_lora_rank:  # latent attention: DeepSeek-V3 (tools/hf_deepseek.py)
        return hf_deepseek.hf_model(cfg)

    if cfg.n_experts:  # a Llama with experts: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE
        return hf_moe.hf_model(cfg)
    if cfg.qk_norm_whole:
        raise ValueError(
            "--qk-norm-whole without experts has no transformers class here (OLMoE: with "
            "--n-experts); train with --qk-norm (Qwen3) to export"
        )

    # the transformers config and the name map of each architecture
    if cfg.arch == "llama":
        # Qwen2 (q, k, v biases) or Qwen3 (QK-norm) where the block has them, else Llama
        kind = "qwen2" if cfg.qkv_bias else "qwen3" if cfg.qk_norm else "llama"
        if cfg.qkv_bias and cfg.qk_norm:
            raise ValueError(
                "--qkv-bias with --qk-norm has no transformers class (Qwen2: biases, Qwen3: "
                "QK-norm); train with one of them to export"
            )
        config_class, model_class = dict(
            llama=(transformers.LlamaConfig, transformers.LlamaForCausalLM),
            qwen2=(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            qwen3=(transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        )[kind]
        # (dynamic NTK's frequencies change past max_position_embeddings: the original context)
        dynamic = cfg.rope_type == "dynamic" and cfg.rope_scaling != 1.0
        hf_cfg = config_class(
            vocab_size=v,
            hidden_size=cfg.n_embd,
            intermediate_size=cfg.ffn,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.n_embd // cfg.n_head,
            hidden_act="silu",
            max_position_embeddings=cfg.rope_original_context if dynamic else cfg.block_size,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,
            rope_scaling=hf_rope(cfg),
            tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=v - 1,
            eos_token_id=v - 1,
            **(dict(attention_bias=False, mlp_bias=False) if kind == "llama" else {}),
            **(dict(attention_bias=False) if kind == "qwen3" else {}),
        )
        names = llama_name_map(cfg.n_layer, cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm)
    else:
        check_gpt2(cfg)
        hf_cfg = transformers.GPT2Config(
            vocab_size=v,
            n_positions=cfg.block_size,
            n_embd=cfg.n_embd,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            activation_function="gelu_new",
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout,
            layer_norm_epsilon=cfg.norm_eps,
            bos_token_id=v - 1,
            eos_token_id=v - 1,
            tie_word_embeddings=True,
        )
        names, model_class = (
            {k: (n,) for k, n in name_map(cfg.n_layer).items()},
            transformers.GPT2LMHeadModel,
        )
    hf_cfg.architectures = [model_class.__name__]
    return hf_cfg, model_class, names


def _part(ours, i, k, cfg, tensors):
    """Part i of k of the nanomega tensor `ours` (of tensors, one) as transformers holds it: padded
    rows dropped, GPT-2's Conv1D weights transposed, [k; v] and [gate; up] cut by rows."""
    t = tensors[0].float()
    t = t[: cfg.vocab_size] if ours in _PADDED else t  # (V_padded, h) -> (V, h)
    t = t.t() if ours.endswith(_CONV1D) and cfg.arch == "gpt2" else t
    # its own contiguous memory: safetensors refuses shared storage and strides
    return t.chunk(k)[i].clone(memory_format=torch.contiguous_format)


def hf_tensors(cfg: GPTConfig):
    """[(transformers name, [nanomega names], make)]: each tensor of cfg's transformers model, the
    nanomega parameters it is made of, and make(their full tensors) -> it. One tensor at a time:
    tools/hf_shards.py streams an export with it."""
    if cfg.kv_lora_rank:
        return hf_deepseek.hf_tensors(cfg)
    if cfg.n_experts:
        return hf_moe.hf_tensors(cfg)
    return [
        (name, [ours], functools.partial(_part, ours, i, len(theirs), cfg))
        for ours, theirs in hf_model(cfg)[2].items()
        for i, name in enumerate(theirs)
    ]


def to_hf(weights, cfg: GPTConfig):
    """The transformers model of cfg (hf_model) from nanomega full weights {name: tensor}, in
    memory (fp32; padded rows dropped)."""
    hf_cfg, model_class, _ = hf_model(cfg)
    # transformers' DeepSeek-V3 class holds no MTP module (a folder export writes them)
    tensors = hf_deepseek.hf_tensors(cfg, mtp=False) if cfg.kv_lora_rank else hf_tensors(cfg)
    state = {name: make([weights[n] for n in ours]) for name, ours, make in tensors}

    # loaded; a mapping that left a weight out is refused
    model = model_class(hf_cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # tied / causal buffer
    left = [k for k in missing if k != "lm_head.weight" and not k.endswith(".attn.bias")]
    if left or unexpected or (not cfg.tie_embeddings and "lm_head.weight" in missing):
        raise ValueError(
            f"{cfg.arch} mapping incomplete: missing {left[:3]}, unexpected {unexpected[:3]}"
        )
    model.tie_weights()
    return model.eval()


def from_hf(model):
    """(GPTConfig, nanomega full weights) from a transformers GPT-2, Llama, Qwen2, Qwen3, Mixtral or
    Qwen2-MoE model (by its model_type); refuses what nanomega cannot compute, and any other type,
    in one line."""
    if model.config.model_type in hf_moe.CONFIGS:  # Mixtral, Qwen2-MoE
        return hf_moe.from_hf(model)
    if model.config.model_type == "deepseek_v3":
        return hf_deepseek.from_hf(model)

    kind = model.config.model_type
    if kind in DENSE:
        cfg = llama_config(model.config.to_dict(), kind)
        theirs = model.state_dict()
        # a copy, even of one tensor
        names = llama_name_map(cfg.n_layer, cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm)
        weights = {
            ours: torch.cat([theirs[n].detach().float() for n in names])
            for ours, names in names.items()
        }
        return cfg, _pad_vocab(weights, cfg)
    if kind != "gpt2":
        raise ValueError(
            f"model_type {kind!r}: nanomega reads gpt2, {', '.join(DENSE)}, mixtral, qwen2_moe and deepseek_v3 models"
        )

    # GPT-2: what nanomega cannot compute is refused
    cfg = gpt2_config(model.config.to_dict())

    theirs = model.state_dict()
    weights = {}
    for ours, name in name_map(cfg.n_layer).items():
        t = theirs[name].detach().float()
        weights[ours] = t.t().contiguous() if ours.endswith(_CONV1D) else t.clone()
    return cfg, _pad_vocab(weights, cfg)


def gpt2_config(c: dict) -> GPTConfig:
    """The GPTConfig of a transformers GPT-2 config (config.json's dict); every field nanomega
    cannot compute is named in one ValueError line."""
    act, n_inner = c.get("activation_function", "gelu_new"), c.get("n_inner")
    bad = [
        (
            act not in ("gelu_new", "gelu_pytorch_tanh"),
            f"activation_function {act!r} (nanomega: tanh GeLU)",
        ),
        (n_inner not in (None, 4 * c["n_embd"]), f"n_inner {n_inner} (nanomega: 4 x n_embd)"),
        (c.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx"),
        (not c.get("scale_attn_weights", True), "scale_attn_weights False"),
        (c.get("tie_word_embeddings") is False, "an untied LM head"),
    ]
    bad = [why for is_bad, why in bad if is_bad]
    if bad:
        raise ValueError(
            f"this GPT-2 differs from nanomega's: {'; '.join(bad)}; it cannot be imported exactly"
        )
    return GPTConfig(
        vocab_size=c["vocab_size"],
        block_size=c["n_positions"],
        n_layer=c["n_layer"],
        n_head=c["n_head"],
        n_embd=c["n_embd"],
        dropout=c.get("resid_pdrop", 0.1),  # transformers' defaults where a field is absent
        norm_eps=c.get("layer_norm_epsilon", 1e-5),
    )


def _pad_vocab(weights, cfg):
    """Zero rows up to the padded vocabulary: never looked up, out of the loss, never sampled."""
    for name in _PADDED:
        if name in weights:
            t = weights[name]
            weights[name] = torch.cat(
                [t, t.new_zeros(cfg.padded_vocab_size - cfg.vocab_size, t.shape[1])]
            )
    return weights
