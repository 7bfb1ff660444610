"""Model presets: one table of named shapes, read by `train.py --model NAME` and the planner.

Idea: keys are gpt_config.SHAPE_KEYS (GPTConfig's field names), so `GPTConfig(**PRESETS[name])`
is the model. The trainer takes the shape and keeps its tokenizer's vocabulary (the data decides
it); the planner takes the vocabulary too; explicit shape flags override a preset in both. A module
of its own, importing only gpt_config.py: the planner must not pull in train.py's flags, nor the
flags the planner. The sources are beside the rows.
Lessons: lessons/01-dense-model.md (the model), lessons/21-planning-a-run.md (the planner).
"""

from nanomega.gpt_config import SHAPE_KEYS


def _shape(
    n_layer,
    n_embd,
    n_head,
    vocab_size,
    block_size,
    alibi=False,
    embed_layernorm=False,
    arch="gpt2",
    n_kv_head=0,
    ffn_hidden=0,
    rope_theta=10000.0,
    rope_scaling=1.0,
    rope_type="llama3",
    rope_original_context=8192,
    rope_mscale_all_dim=0.0,
    qkv_bias=False,
    qk_norm=False,
    qk_norm_whole=False,
    tie_embeddings=True,
    norm_eps=1e-5,
    n_experts=0,
    top_k=2,
    shared_experts=0,
    shared_expert_gate=False,
    first_k_dense=0,
    dense_ffn_hidden=0,
    kv_lora_rank=0,
    q_lora_rank=0,
    qk_nope_head_dim=0,
    qk_rope_head_dim=0,
    v_head_dim=0,
    mtp_num_layers=0,
):
    """One row, in the papers' column order, as {key: value} over gpt_config.SHAPE_KEYS (a key
    added there and not here fails at import)."""
    row = locals()
    return {key: row[key] for key in SHAPE_KEYS}


def _llama(
    n_layer, n_embd, n_head, n_kv_head, ffn_hidden, vocab_size=128256, block_size=8192, **kw
):
    """A Llama 3 row: its params.json / config.json (rope theta 500,000, untied head, RMSNorm eps
    1e-5)."""
    kw = dict(dict(rope_theta=500000.0, tie_embeddings=False), **kw)
    return _shape(
        n_layer,
        n_embd,
        n_head,
        vocab_size,
        block_size,
        arch="llama",
        n_kv_head=n_kv_head,
        ffn_hidden=ffn_hidden,
        **kw,
    )


PRESETS = {
    "tiny": _shape(4, 64, 4, 256, 64),
    # GPT-2 (Radford et al. 2019; nanoGPT's sizes)
    "gpt2-124m": _shape(12, 768, 12, 50257, 1024),
    "gpt2-350m": _shape(24, 1024, 16, 50257, 1024),
    "gpt2-774m": _shape(36, 1280, 20, 50257, 1024),
    "gpt2-1.5b": _shape(48, 1600, 25, 50257, 1024),
    # GPT-3 (Brown et al. 2020), Table 2.1; 1.3B: 16 heads of 128, since the table's 24 heads do not
    # divide 2048
    "gpt3-1.3b": _shape(24, 2048, 16, 50257, 2048),
    "gpt3-6.7b": _shape(32, 4096, 32, 50257, 2048),
    "gpt3-13b": _shape(40, 5120, 40, 50257, 2048),
    "gpt3-175b": _shape(96, 12288, 96, 50257, 2048),
    "opt-175b": _shape(96, 12288, 96, 50272, 2048),  # OPT (Zhang et al. 2022)
    # BLOOM: 70 layers, 14336, 112 heads, a 250,880 padded vocabulary, ALiBi, an embedding LayerNorm
    "bloom-176b": _shape(70, 14336, 112, 250880, 2048, alibi=True, embed_layernorm=True),
    "mt-nlg-530b": _shape(105, 20480, 128, 51200, 2048),  # MT-NLG (Korthikanti et al., Table 3)
    # Narayanan et al. 2021 (Megatron-LM), Table 1 (V = 51,200): the weak-scaling runs the planner's
    # time model is held to
    "megatron-1.7b": _shape(24, 2304, 24, 51200, 2048),
    "megatron-3.6b": _shape(30, 3072, 32, 51200, 2048),
    "megatron-7.5b": _shape(36, 4096, 32, 51200, 2048),
    "megatron-18.4b": _shape(40, 6144, 48, 51200, 2048),
    "megatron-39.1b": _shape(48, 8192, 64, 51200, 2048),
    "megatron-76.1b": _shape(60, 10240, 80, 51200, 2048),
    "megatron-145.6b": _shape(80, 12288, 96, 51200, 2048),
    "megatron-310.1b": _shape(96, 16384, 128, 51200, 2048),
    "megatron-529.6b": _shape(105, 20480, 128, 51200, 2048),
    "megatron-1t": _shape(128, 25600, 160, 51200, 2048),
    # Llama 3 (Grattafiori et al. 2024, Table 3; the released configs; ffn widths by
    # modern.ffn_hidden's rule, written out): 8 key/value heads, 128,256 tokens,
    # pre-trained at 8,192 tokens (3.1 extends to 131,072 with --rope-scaling 8)
    "llama3-8b": _llama(32, 4096, 32, 8, 14336),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248),
    # Mixtral 8x7B (Jiang et al. 2024; its config.json): Mistral 7B's block with 8 SwiGLU experts, 2
    # per token, 32,000 tokens, 32,768-token context, rope theta 1e6: 46.7B parameters, 12.9B active
    # per token
    "mixtral-8x7b": _llama(
        32,
        4096,
        32,
        8,
        14336,
        vocab_size=32000,
        block_size=32768,
        rope_theta=1e6,
        n_experts=8,
        top_k=2,
    ),
    # DeepSeek-V3 671B (arXiv 2412.19437 Sec. 4.2; deepseek-ai/DeepSeek-V3 config.json, the defaults
    # of transformers' DeepseekV3Config): 61 layers, h 7168, 128 heads of latent attention (d_c
    # 512, d_q 1536, d_n 128, d_r 64, d_v 128), the first 3 blocks dense (18,432 wide), then 256
    # routed experts of 2,048 (8 per token) + 1 shared; 129,280 tokens, untied head, RMSNorm eps
    # 1e-6; pre-trained at 4,096 tokens (config.json's 163,840 is after YaRN, rope_scaling 40). Its
    # router (sigmoid, 8 groups, 4 per token, x 2.5) is a flag, not a shape: --router deepseek_v3
    # --n-group 8 --topk-group 4 --routed-scaling 2.5. The MTP module (14B) is not counted.
    "deepseek-v3": _shape(
        61,
        7168,
        128,
        129280,
        4096,
        arch="llama",
        ffn_hidden=2048,
        tie_embeddings=False,
        norm_eps=1e-6,
        n_experts=256,
        top_k=8,
        shared_experts=1,
        first_k_dense=3,
        dense_ffn_hidden=18432,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    # trains on a 2-core CPU in minutes: 4 query heads sharing 2 key/value heads, a tied head
    "llama-small": _shape(4, 128, 4, 4096, 128, arch="llama", n_kv_head=2, ffn_hidden=352),
}
