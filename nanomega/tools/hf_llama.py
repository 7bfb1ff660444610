"""Hugging Face's Llama, read: its config.json as a GPTConfig (llama_config) and its parameter names
(llama_name_map).

nanomega's Llama (model.py with arch="llama", modern.py) is transformers' LlamaForCausalLM up to
names and two stackings: kv_proj = [k_proj; v_proj] and gate_up = [gate_proj; up_proj]. What
nanomega cannot compute is named in one line. tools/hf.py (GPT-2 and Llama in and out) and
tools/hf_moe.py (Mixtral: a Llama whose MLP is experts) both read a Llama through this module.
Lesson: lessons/13-the-modern-block.md
"""

from nanomega.gpt_config import GPTConfig
from nanomega.modern import LLAMA3_HIGH_FREQ, LLAMA3_LOW_FREQ, LLAMA3_ORIGINAL_CONTEXT

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
# Llama 3.1's RoPE constants as transformers names them; nanomega computes these
# values only (modern.py)
LLAMA3_ROPE = {
    "low_freq_factor": LLAMA3_LOW_FREQ,
    "high_freq_factor": LLAMA3_HIGH_FREQ,
    "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
}


def llama_name_map(n_layer, tied=True):
    """{nanomega parameter name: (transformers names)} for a Llama of n_layer blocks; a tied head
    has no name."""
    names = {
        "embed.wte.weight": ("model.embed_tokens.weight",),
        "head.ln_f.weight": ("model.norm.weight",),
    }
    if not tied:
        names["head.lm_head.weight"] = ("lm_head.weight",)
    for i in range(n_layer):
        names.update(
            {
                f"blocks.{i}.{a}": tuple(f"model.layers.{i}.{n}" for n in b)
                for a, b in _LLAMA_BLOCK.items()
            }
        )
    return names


def llama_config(c: dict) -> GPTConfig:
    """The GPTConfig of a transformers Llama config (config.json's dict, as transformers 4 or 5
    writes it); every field nanomega cannot compute is named in one ValueError line."""
    h, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"  # transformers 5 / 4
    rope = c.get(key) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))

    # every field nanomega's Llama cannot match, named
    bad = [
        (c.get("attention_bias"), "attention_bias true (nanomega's Llama has no biases)"),
        (c.get("mlp_bias"), "mlp_bias true (nanomega's Llama has no biases)"),
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
            kind not in ("default", "llama3"),
            f"{key} rope_type {kind!r} (nanomega: none or 'llama3')",
        ),
        (
            rope.get("partial_rotary_factor", 1.0) != 1.0,
            f"{key} partial_rotary_factor {rope.get('partial_rotary_factor')} (nanomega: 1)",
        ),
    ]
    if kind == "llama3":
        bad += [
            (rope.get(k) != v, f"{key} {k} {rope.get(k)} (nanomega's llama3 rule: {v:g})")
            for k, v in LLAMA3_ROPE.items()
        ]

    bad = [why for is_bad, why in bad if is_bad]
    if bad:
        raise ValueError(
            f"this Llama differs from nanomega's: {'; '.join(bad)}; it cannot be imported exactly"
        )

    # transformers' defaults where a field is absent
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    return GPTConfig(
        arch="llama",
        vocab_size=c["vocab_size"],
        block_size=c.get("max_position_embeddings", 2048),
        n_layer=c["num_hidden_layers"],
        n_head=nh,
        n_kv_head=nkv,
        n_embd=h,
        ffn_hidden=c["intermediate_size"],
        rope_theta=float(theta),
        rope_scaling=float(rope["factor"]) if kind == "llama3" else 1.0,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        norm_eps=c.get("rms_norm_eps", 1e-6),
    )
