"""Hugging Face's Llama, Qwen2 and Qwen3, read: config.json as a GPTConfig (llama_config), the
parameter names (llama_name_map) and the RoPE rule written back (hf_rope).

nanomega's Llama (model.py with arch="llama", modern.py) is transformers' LlamaForCausalLM up to
names and two stackings: kv_proj = [k_proj; v_proj] and gate_up = [gate_proj; up_proj]. Qwen2 and
Qwen2.5 are that Llama with biases on q, k and v (qkv_bias: kv_proj.bias = [k_proj.bias;
v_proj.bias]); Qwen3 has none, and RMS-normalizes each head of q and k before RoPE (qk_norm). RoPE
scaling: llama3, linear, dynamic and yarn as transformers computes them (modern.rope_frequencies).
What nanomega cannot compute is named in one line. tools/hf.py (in and out) and tools/hf_moe.py
(Mixtral: a Llama whose MLP is experts) read a Llama through this module.
Lesson: lessons/02-the-modern-block.md
"""

from nanomega.gpt_config import ROPE_TYPES, GPTConfig
from nanomega.modern import LLAMA3_HIGH_FREQ, LLAMA3_LOW_FREQ, YARN_BETA_FAST, YARN_BETA_SLOW

# nanomega name -> transformers LlamaForCausalLM names, per block (model.layers.{i}.); two names:
# stacked by rows
_LLAMA_BLOCK = {
    "ln_1.weight": ("input_layernorm.weight",),
    "ln_2.weight": ("post_attention_layernorm.weight",),
    "attn.q_proj.weight": ("self_attn.q_proj.weight",),
    "attn.c_proj.weight": ("self_attn.o_proj.weight",),
    "attn.kv_proj.weight": ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.c_proj.weight": ("mlp.down_proj.weight",),
}
# Qwen2's q, k, v biases and Qwen3's QK-norm scales, per block
_QKV_BIAS = {
    "attn.q_proj.bias": ("self_attn.q_proj.bias",),
    "attn.kv_proj.bias": ("self_attn.k_proj.bias", "self_attn.v_proj.bias"),
}
_QK_NORM = {
    "attn.q_norm.weight": ("self_attn.q_norm.weight",),
    "attn.k_norm.weight": ("self_attn.k_norm.weight",),
}
# the constants of each RoPE rule as transformers names them; nanomega computes these values only
# (modern.py); any other value is refused
ROPE_CONSTANTS = {
    "llama3": {"low_freq_factor": LLAMA3_LOW_FREQ, "high_freq_factor": LLAMA3_HIGH_FREQ},
    "yarn": {
        "beta_fast": YARN_BETA_FAST,
        "beta_slow": YARN_BETA_SLOW,
        "attention_factor": None,
        "mscale": None,
        "mscale_all_dim": None,
        "truncate": True,
    },
}
# the model types read as nanomega's Llama (Mixtral: tools/hf_moe.py)
DENSE = ("llama", "qwen2", "qwen3")


def llama_name_map(n_layer, tied=True, qkv_bias=False, qk_norm=False):
    """{nanomega parameter name: (transformers names)} for a Llama (Qwen2: qkv_bias, Qwen3:
    qk_norm) of n_layer blocks; a tied head has no name."""
    names = {
        "embed.wte.weight": ("model.embed_tokens.weight",),
        "head.ln_f.weight": ("model.norm.weight",),
    }
    if not tied:
        names["head.lm_head.weight"] = ("lm_head.weight",)
    block = _LLAMA_BLOCK | (_QKV_BIAS if qkv_bias else {}) | (_QK_NORM if qk_norm else {})
    for i in range(n_layer):
        names.update(
            {f"blocks.{i}.{a}": tuple(f"model.layers.{i}.{n}" for n in b) for a, b in block.items()}
        )
    return names


def hf_rope(cfg: GPTConfig):
    """The rope_scaling table transformers reads for cfg's RoPE rule, or None (no scaling)."""
    if cfg.rope_scaling == 1.0:
        return None
    table = dict(rope_type=cfg.rope_type, factor=cfg.rope_scaling)
    if cfg.rope_type in ("llama3", "yarn"):
        table["original_max_position_embeddings"] = cfg.rope_original_context
    consts = ROPE_CONSTANTS.get(cfg.rope_type, {})
    return table | {k: v for k, v in consts.items() if v is not None}


def llama_config(c: dict, kind="llama") -> GPTConfig:
    """The GPTConfig of a transformers Llama, Qwen2 or Qwen3 config (`kind`; config.json's dict, as
    transformers 4 or 5 writes it); every field nanomega cannot compute is named in one ValueError
    line."""
    h, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"  # transformers 5 / 4
    rope = c.get(key) or {}
    rule = rope.get("rope_type", rope.get("type", "default"))
    # Qwen2 has q, k, v biases (no field says so); Qwen3's attention_bias would bias o_proj too
    biased = "attention_bias true (nanomega: biases on q, k and v only, as Qwen2)"
    window = c.get("use_sliding_window") or "sliding_attention" in (c.get("layer_types") or [])

    # every field nanomega's Llama cannot match, named
    bad = [
        (kind != "qwen2" and c.get("attention_bias"), biased),
        (c.get("mlp_bias"), "mlp_bias true (nanomega's Llama has no MLP biases)"),
        (kind != "llama" and window, "use_sliding_window (nanomega: full causal attention)"),
        (
            c.get("hidden_act", "silu") != "silu",
            f"hidden_act {c.get('hidden_act')!r} (nanomega: silu)",
        ),
        (
            h % nh or c.get("head_dim") not in (None, h // nh),
            f"head_dim {c.get('head_dim')} (nanomega: hidden_size / num_attention_heads = {h / nh:g})",
        ),
        (nh % nkv, f"num_key_value_heads {nkv} (nanomega: a divisor of num_attention_heads {nh})"),
        (
            rule not in ("default",) + ROPE_TYPES,
            f"{key} rope_type {rule!r} (nanomega: none, {', '.join(ROPE_TYPES)})",
        ),
        (
            rope.get("partial_rotary_factor", 1.0) != 1.0,
            f"{key} partial_rotary_factor {rope.get('partial_rotary_factor')} (nanomega: 1)",
        ),
        (rule != "default" and not rope.get("factor"), f"{key} factor {rope.get('factor')}"),
    ]
    bad += [
        (rope.get(k, v) != v, f"{key} {k} {rope.get(k)} (nanomega's {rule} rule: {v})")
        for k, v in ROPE_CONSTANTS.get(rule, {}).items()
    ]
    if rule in ("llama3", "yarn"):
        bad.append((not rope.get("original_max_position_embeddings"), f"{key} no original context"))

    bad = [why for is_bad, why in bad if is_bad]
    if bad:
        raise ValueError(
            f"this {kind} differs from nanomega's Llama: {'; '.join(bad)}; it cannot be imported "
            f"exactly"
        )

    # transformers' defaults where a field is absent; dynamic starts at max_position_embeddings
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    context = c.get("max_position_embeddings", 2048)
    original = rope.get("original_max_position_embeddings") if rule != "dynamic" else context
    return GPTConfig(
        arch="llama",
        vocab_size=c["vocab_size"],
        block_size=context,
        n_layer=c["num_hidden_layers"],
        n_head=nh,
        n_kv_head=nkv,
        n_embd=h,
        ffn_hidden=c["intermediate_size"],
        rope_theta=float(theta),
        rope_scaling=1.0 if rule == "default" else float(rope["factor"]),
        rope_type="llama3" if rule == "default" else rule,
        rope_original_context=original or 8192,
        qkv_bias=kind == "qwen2",
        qk_norm=kind == "qwen3",
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        norm_eps=c.get("rms_norm_eps", 1e-6),
    )
