"""Multi-head latent attention (mla.py): transformers' DeepseekV3Attention with our weights, its
formulas (parameters, KV cache, FLOPs), recompute, and tp2 / tp2 + SP / pp2 / cp2 (ring,
all-gather, Ulysses) equal to one process.

transformers: the attention of a small random DeepSeek-V3 config (q latent 12 or none, kv latent
16, d_n 8, d_r 8, d_v 6 on h = 32, 4 heads), weights at scale (matrices N(0, 1/fan_in), norm scales
1 +- 0.2) so outputs are O(1); rope_interleave false, our rotate-half layout. Tolerance 1e-5
absolute on outputs of size ~1: the same fp32 operations in another order (transformers' sdpa
against our eager core: sums of <= 32 terms, 2 gamma(32) ~ 4e-6 relative to sum |terms| ~ 1). The
rotary layout matters: the interleaved config differs by > 1e-3, and equals ours once the rotary
rows of W_qb and W_kva are permuted (tools/hf_deepseek.interleaved: what a DeepSeek-V3 import
does).
FLOPs: torch's FlopCounterMode over a forward and backward (eager core) counts the matmuls alone:
formulas.model_flops_per_token less 6 x the norm scales' parameters (no matmul) per token, exactly.
tp2, tp2 + SP, pp2 (1F1B), cp2 (ring, all-gather, Ulysses: their cores see v of another head
size than q and k, padded): tests/test_llama.py's tolerance (layout_rtol), 4 steps, losses,
validation loss and the resharded weights; the latents' norm scales start at 1 and move, so their
gradient's sum over tp (each rank's heads' share) is in the comparison (left unsummed, a weight
moves 7e-4 off: fails); full and selective recompute run inside the tp layouts.
"""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nanomega import checkpoint, cp, formulas, reshard, train, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.tools.hf_deepseek import ATTENTION as NAMES
from nanomega.tools.hf_deepseek import interleaved
from test_layouts import curve, flags, run_layouts
from test_llama import RTOL
from test_llama import COMMON as LLAMA

SHAPE = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def mla_cfg(**kw):
    base = dict(arch="llama", n_layer=2, n_head=4, n_embd=32, ffn_hidden=64, block_size=16)
    return GPTConfig(**{**base, "vocab_size": 256, "q_lora_rank": 12, **SHAPE, **kw})


@torch.no_grad()
def at_scale(module, seed=0):
    """Matrices N(0, 1/fan_in), norm scales 1 +- 0.2: every piece moves the output by O(1)."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        if p.dim() == 2:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
        else:
            p.copy_(1 + 0.2 * (2 * torch.rand(p.shape, generator=g) - 1))


def deepseek_v3(cfg, interleave=False):
    """transformers' DeepseekV3Attention and rotary embedding for cfg's attention."""
    transformers = pytest.importorskip(
        "transformers", reason="the hf extra (transformers, safetensors) is not installed"
    )
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    config = transformers.DeepseekV3Config(
        hidden_size=cfg.n_embd,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head,
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleave=interleave,
        rms_norm_eps=cfg.norm_eps,
        attention_bias=False,
        rope_theta=cfg.rope_theta,
    )
    config._attn_implementation = "sdpa"
    return ds.DeepseekV3Attention(config, layer_idx=0), ds.DeepseekV3RotaryEmbedding(config)


@pytest.mark.parametrize("q_lora", [12, 0])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_mla_is_transformers_deepseek_v3_attention(q_lora, attention):
    # d_r 8: the interleaving permutation is not its own inverse (at d_r 4 it is)
    cfg = mla_cfg(q_lora_rank=q_lora, attention=attention, norm_eps=1e-6, qk_rope_head_dim=8)
    ours = GPT(cfg, seed=0).blocks["0"].attn
    at_scale(ours)
    x = torch.randn(2, cfg.block_size, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    outs = []
    # rotate-half (ours), interleaved with our weights, interleaved with the rotary rows permuted
    for interleave, permute in ((False, False), (True, False), (True, True)):
        theirs, rotary = deepseek_v3(cfg, interleave)
        with torch.no_grad():
            for name, p in ours.named_parameters():
                module, leaf = name.split(".")
                w = interleaved(module, p, cfg) if permute else p
                getattr(theirs, NAMES[module]).get_parameter(leaf).copy_(w)
            cos_sin = rotary(x, torch.arange(cfg.block_size)[None])
            outs.append(theirs(x, position_embeddings=cos_sin, attention_mask=None)[0])
    with torch.no_grad():
        got = ours(x)
    assert got.abs().mean() > 0.1  # outputs of size ~1: the tolerance is relative to them
    torch.testing.assert_close(got, outs[0], rtol=0, atol=1e-5)
    assert (got - outs[1]).abs().max() > 1e-3  # another rotary layout is told apart
    torch.testing.assert_close(got, outs[2], rtol=0, atol=1e-5)  # ... and is a permutation


def test_parameters_kv_cache_and_flops_formulas():
    # parameters: one layer, and its tp2 shard of each weight (q_b, kv_b, o by heads)
    for q_lora in (12, 0):
        cfg = mla_cfg(q_lora_rank=q_lora)
        attn = GPT(cfg, seed=0).blocks["0"].attn
        held = sum(p.numel() for p in attn.parameters())
        split = sum(
            p.numel()
            for n, p in attn.named_parameters()
            if n.split(".")[0] in ("q_b_proj", "q_proj")
        )
        split += attn.kv_b_proj.weight.numel() + attn.c_proj.weight.numel()
        dims = (cfg.n_embd, cfg.n_head, q_lora, 16, 8, 4, 6)
        assert formulas.mla_attention_params(*dims) == held
        assert formulas.mla_attention_params(*dims, t=2) == held - split // 2

    # the KV cache: what the latent projection keeps per token (d_c + d_r), every layer
    cfg = mla_cfg()
    attn = GPT(cfg, seed=0).blocks["0"].attn
    assert formulas.kv_cache_bytes_per_token(cfg) == cfg.n_layer * attn.kv_a_proj.out_features * 2
    # DeepSeek-V3 (config.json: 61 layers, d_c 512, d_r 64, 128 heads of 128): 70,272 bytes in bf16,
    # DeepSeek-V2's Table 1 form 4.5 d_h l; multi-head attention would keep 2 a d_h l
    v3 = GPTConfig(arch="llama", n_layer=61, n_head=128, n_embd=7168, kv_lora_rank=512)
    v3.qk_rope_head_dim, v3.qk_nope_head_dim, v3.v_head_dim = 64, 128, 128
    assert formulas.kv_cache_bytes_per_token(v3) == 61 * 4.5 * 128 * 2 == 70_272
    mha = GPTConfig(arch="llama", n_layer=61, n_head=128, n_embd=128 * 128)
    assert formulas.kv_cache_bytes_per_token(mha) == 2 * 128 * 128 * 61 * 2

    # FLOPs: the matmuls of a forward and backward, counted by torch
    model = GPT(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    norms = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1)
    per_token = formulas.model_flops_per_token(cfg) - 6 * norms
    assert counter.get_total_flops() == idx.numel() * per_token


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_is_bitwise_no_recompute(mode):
    from nanomega.recompute import apply_recompute

    cfg = mla_cfg()
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    grads = []
    for m in ("none", mode):
        model = apply_recompute(GPT(cfg, seed=0), m)
        model(idx, idx).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_refused_in_one_line():
    with pytest.raises(ValueError, match="leave out --n-kv-head"):
        mla_cfg(n_kv_head=2).validate()
    with pytest.raises(ValueError, match="set --kv-lora-rank > 0 too"):
        mla_cfg(kv_lora_rank=0).validate()
    with pytest.raises(ValueError, match="--qk-rope-head-dim 5: rotary positions need an even"):
        mla_cfg(qk_rope_head_dim=5).validate()


# tp2: test_llama.py's Llama (h 32, 4 heads, f 64, untied) with MLA instead of grouped-query heads
COMMON = [*LLAMA[:6], *LLAMA[8:]]  # without --n-kv-head 2
MLA_FLAGS = ["--kv-lora-rank", "16", "--q-lora-rank", "12", "--qk-nope-head-dim", "8"]
MLA_FLAGS += ["--qk-rope-head-dim", "4", "--v-head-dim", "6"]
BATCH = ["--batch-size", "2", "--grad-accum", "4"]
LAYOUTS = [  # global batch 8 everywhere
    ("tp2-full", ["--tp", "2", "--recompute", "full", *BATCH]),
    ("tp2-sp-selective", ["--tp", "2", "--sequence-parallel", "--recompute", "selective", *BATCH]),
    ("pp2-1f1b", ["--pp", "2", "--batch-size", "1", "--grad-accum", "8"]),
    *((f"cp2-{m}", ["--cp", "2", "--cp-method", m, *BATCH]) for m in cp.METHODS),
]
CORPUS_CHARS = 200_000


def test_tp2_sp_pp2_and_cp2_equal_dense(corpus, tmp_path):
    assert "--n-kv-head" not in COMMON and "--n-head" in COMMON
    layouts = [(name, MLA_FLAGS + layout) for name, layout in LAYOUTS]
    worlds.launch(run_layouts, 2, corpus, tmp_path, layouts, None, COMMON, timeout=600)
    dense = tmp_path / "dense"
    train.main(flags(corpus, dense, MLA_FLAGS + BATCH, COMMON))
    (ref, ref_val), b = curve(dense), reshard.full_weights(checkpoint.latest(dense))
    assert ref[-1] < ref[0] - 0.05  # it trains, and the curves can be told apart
    assert (b["blocks.0.attn.kv_a_norm.weight"] - 1).abs().max() > 1e-3  # the latents' norms moved
    for name, _ in LAYOUTS:
        losses, val = curve(tmp_path / name)
        assert losses == pytest.approx(ref, rel=RTOL) and val == pytest.approx(ref_val, rel=RTOL)
        a = reshard.full_weights(checkpoint.latest(tmp_path / name))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(
                a[k], b[k], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} {k}: {m}"
            )


def test_dry_run_planner_bytes_are_the_engine_bytes():
    """DeepSeek-V3's attention (config.json: h 7168, 128 heads, d_q 1536, d_c 512, d_n 128, d_r 64,
    d_v 128) on a dense 4-layer Llama at tp8 x pp2 x dp2 on paper: the planner counts MLA's
    parameters as each rank's engine holds them (the latents whole, the rest split by heads)."""
    from test_meta import assert_planner_is_engine, dry_run

    base = ["--arch", "llama", "--n-layer", "4", "--n-embd", "7168", "--n-head", "128"]
    base += ["--kv-lora-rank", "512", "--q-lora-rank", "1536", "--qk-nope-head-dim", "128"]
    base += ["--qk-rope-head-dim", "64", "--v-head-dim", "128", "--ffn-hidden", "18432"]
    base += ["--tp", "8", "--pp", "2", "--world", "32", "--zero", "1", "--dtype", "bf16"]
    for rank in (0, 31):
        res = dry_run([*base, "--grad-accum", "2", "--rank", str(rank)])
        assert_planner_is_engine(res)
