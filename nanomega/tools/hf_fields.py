"""The fields of each model type's config.json that nanomega reads, and the rule each must meet
(tools/hf_check.py checks a folder against them before a weight is read).

Idea: a field is required or optional (absent or null: transformers' default), and has a rule -- an
integer >= 1, a finite number > 0 or >= 0, a flag, a table. FIELD_OF_FLAG names the field that set
a flag, so a training check's refusal of an imported shape names the file's field, not our flag.
Lesson: lessons/02-the-modern-block.md
"""

import math

# a field's rule: (what it must be, test); a number is an int or float, never a bool
_NUMBER = (int, float)
SIZE = ("an integer >= 1", lambda v: type(v) is int and v >= 1)
COUNT = ("an integer >= 0", lambda v: type(v) is int and v >= 0)
POSITIVE = ("a finite number > 0", lambda v: isinstance(v, _NUMBER) and 0 < v < math.inf)
COEFFICIENT = ("a finite number >= 0", lambda v: isinstance(v, _NUMBER) and 0 <= v < math.inf)
FLAG = ("true or false", lambda v: type(v) is bool)
TABLE = ("an object or null", lambda v: isinstance(v, dict))

# model_type -> {field: (required, rule)}; an absent optional field takes transformers' default,
# null is absent
_LLAMA = {
    "vocab_size": (True, SIZE),
    "hidden_size": (True, SIZE),
    "intermediate_size": (True, SIZE),
    "num_hidden_layers": (True, SIZE),
    "num_attention_heads": (True, SIZE),
    "num_key_value_heads": (False, SIZE),
    "head_dim": (False, SIZE),
    "max_position_embeddings": (False, SIZE),
    "rms_norm_eps": (False, POSITIVE),
    "rope_theta": (False, POSITIVE),
    "rope_scaling": (False, TABLE),
    "rope_parameters": (False, TABLE),
    "tie_word_embeddings": (False, FLAG),
}
FIELDS = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "mixtral": _LLAMA
    | {
        "num_local_experts": (True, SIZE),
        "num_experts_per_tok": (True, SIZE),
        "router_aux_loss_coef": (False, COEFFICIENT),
    },
    "qwen2_moe": _LLAMA
    | {
        "moe_intermediate_size": (True, SIZE),
        "shared_expert_intermediate_size": (True, SIZE),
        "num_experts": (True, SIZE),
        "num_experts_per_tok": (True, SIZE),
        "norm_topk_prob": (False, FLAG),
        "qkv_bias": (False, FLAG),
        "router_aux_loss_coef": (False, COEFFICIENT),
    },
    "qwen3_moe": _LLAMA
    | {
        "moe_intermediate_size": (True, SIZE),
        "num_experts": (False, SIZE),  # or, as transformers 5 writes it:
        "num_local_experts": (False, SIZE),
        "num_experts_per_tok": (True, SIZE),
        "norm_topk_prob": (False, FLAG),
        "decoder_sparse_step": (False, SIZE),
        "router_aux_loss_coef": (False, COEFFICIENT),
    },
    "olmoe": _LLAMA
    | {
        "num_experts": (True, SIZE),
        "num_experts_per_tok": (True, SIZE),
        "norm_topk_prob": (False, FLAG),
        "router_aux_loss_coef": (False, COEFFICIENT),
    },
    "deepseek_v3": _LLAMA
    | {
        "moe_intermediate_size": (True, SIZE),
        "kv_lora_rank": (True, SIZE),
        "q_lora_rank": (False, SIZE),  # null: one q_proj
        "qk_nope_head_dim": (True, SIZE),
        "qk_rope_head_dim": (True, SIZE),
        "v_head_dim": (True, SIZE),
        "n_routed_experts": (True, SIZE),
        "num_experts_per_tok": (True, SIZE),
        "n_shared_experts": (False, COUNT),
        "first_k_dense_replace": (False, COUNT),
        "n_group": (False, SIZE),
        "topk_group": (False, SIZE),
        "routed_scaling_factor": (False, POSITIVE),
        "norm_topk_prob": (False, FLAG),
        "aux_loss_alpha": (False, COEFFICIENT),
        "num_nextn_predict_layers": (False, COUNT),  # DeepSeek's name; transformers 5's:
        "num_mtp_layers": (False, COUNT),
    },
    "gpt2": {
        "vocab_size": (True, SIZE),
        "n_positions": (True, SIZE),
        "n_embd": (True, SIZE),
        "n_layer": (True, SIZE),
        "n_head": (True, SIZE),
        "n_inner": (False, SIZE),
        "layer_norm_epsilon": (False, POSITIVE),
    },
}
# nanomega's flag -> the field of config.json that sets it, to name a training check's refusal
FIELD_OF_FLAG = {
    "gpt2": dict(
        vocab_size="vocab_size",
        block_size="n_positions",
        n_embd="n_embd",
        n_layer="n_layer",
        n_head="n_head",
        norm_eps="layer_norm_epsilon",
    ),
    "llama": dict(
        vocab_size="vocab_size",
        block_size="max_position_embeddings",
        n_embd="hidden_size",
        n_layer="num_hidden_layers",
        n_head="num_attention_heads",
        n_kv_head="num_key_value_heads",
        ffn_hidden="intermediate_size",
        norm_eps="rms_norm_eps",
        rope_theta="rope_theta",
        rope_scaling="rope_scaling factor",
        n_experts="num_local_experts",
        top_k="num_experts_per_tok",
        moe_aux_loss="router_aux_loss_coef",
    ),
}
