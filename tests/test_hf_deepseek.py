"""Issue 48: DeepSeek-V3 in and out (tools/hf_deepseek.py): latent attention, dense blocks before
MoE ones, shared experts, the deepseek_v3 router (groups, bias, scaling).

Claims (one process; transformers builds the model offline from a small random config):
    export    nanomega's model (3 blocks, the first dense of its own width, then 8 experts in 4
              groups of which 2 allowed, top-2, scaling 2.5, a random routing bias, 1 shared expert;
              q latent or none) as transformers' DeepseekV3ForCausalLM: logits within 1e-4 (fp32,
              the same math in another order); a latent-attention model without experts as the
              same class with every block dense
    import    back: every shape and routing field, every weight and routing bias bitwise; an
              interleaved folder (rope_interleave, DeepSeek's released layout) reads as the same
              model (its rotary rows permuted), and read without the permutation differs by > 1e-3
    aux loss  DeepSeek-V3's sequence-wise loss (arXiv 2412.19437 eq. 17-20) computed from the paper
              = moe.balance_loss: the coefficient travels unchanged (aux_loss_alpha)
    refused   what nanomega cannot compute is one line; the released config.json (YaRN with
              mscale_all_dim, FP8 weights) names both reasons
    folders   through `nanomega.tools.hf import/export`: weights and routing biases bitwise (the
              biases in the checkpoint's moe_bias table), the exported folder's tensors and logits =
              the source's; MTP modules as DeepSeek's model.layers.{L + d}.* both ways, bitwise
              (transformers' class reports them unexpected and skips them)
"""

import copy
import dataclasses
import math

import pytest
import torch

from nanomega import moe
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT

transformers = pytest.importorskip("transformers", reason="the test extra: transformers")
from nanomega.tools import hf_deepseek, hf_weights  # noqa: E402  (needs transformers)

SHAPE = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6)
ROUTING = dict(n_experts=8, top_k=2, router="deepseek_v3", n_group=4, topk_group=2)
MOE = dict(**ROUTING, routed_scaling=2.5, shared_experts=1, first_k_dense=1, dense_ffn_hidden=40)
IDX = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(1))


def ds_cfg(**kw):
    base = dict(vocab_size=200, block_size=32, n_layer=3, n_head=4, n_embd=32, ffn_hidden=16)
    base |= dict(arch="llama", tie_embeddings=False, attention="eager", norm_eps=1e-6)
    return GPTConfig(**{**base, **SHAPE, "q_lora_rank": 12, "moe_aux_loss": 1e-3, **kw})


def random_model(cfg):
    """Our model with matrices of std 0.1, norm scales 1 +- 0.1 and a random routing bias: routing
    far from uniform, logits of size ~1 (the 1e-4 bound is relative to them)."""
    ours = GPT(cfg, seed=3).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_((p.dim() == 1) + 0.1 * torch.randn(p.shape, generator=g))
        for layer in moe.layers(ours).values():
            layer.expert_bias.copy_(0.05 * torch.randn(cfg.n_experts, generator=g))
    return ours


def state(model):
    """Every weight and routing bias (what export reads and import gives back)."""
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kw", [dict(MOE), dict(MOE, q_lora_rank=0), {}], ids=["moe", "q0", "mla"])
def test_deepseek_v3_round_trip_logits(kw):
    cfg = ds_cfg(**kw)
    ours = random_model(cfg)
    weights = state(ours)
    theirs = hf_weights.to_hf(weights, cfg)
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        got, want = theirs(IDX).logits, ours(IDX)[..., : cfg.vocab_size]
    assert want.std() > 0.3 and (got - want).abs().max().item() < 1e-4

    cfg2, back = hf_weights.from_hf(theirs)
    assert dataclasses.replace(cfg2, attention="eager") == cfg
    rows = {"embed.wte.weight": cfg.vocab_size, "head.lm_head.weight": cfg.vocab_size}
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k][: rows.get(k)], weights[k][: rows.get(k)]) for k in back)


def test_deepseek_yarn_is_transformers_and_needs_its_score_scale():
    """DeepSeek's YaRN (mscale = mscale_all_dim = 1, as its config.json; factor 4 over an original
    context of 8, positions up to 24): transformers' logits within 1e-4 both ways, the config back
    field by field; without the mscale^2 on every score (planted) it is > 1e-3 off."""
    yarn = dict(rope_scaling=4.0, rope_type="yarn", rope_original_context=8)
    cfg = ds_cfg(**MOE, **yarn, rope_mscale_all_dim=1.0)
    ours = random_model(cfg)
    theirs = hf_weights.to_hf(state(ours), cfg)
    assert theirs.config.rope_parameters["mscale_all_dim"] == 1.0
    with torch.no_grad():
        got, want = theirs(IDX).logits, ours(IDX)[..., : cfg.vocab_size]
        assert (got - want).abs().max() < 1e-4
        cfg2, _ = hf_weights.from_hf(theirs)
        assert dataclasses.replace(cfg2, attention="eager") == cfg
        for block in ours.blocks.values():
            block.attn.score_scale = 1.0  # planted: nanomega's plain YaRN
        assert (got - ours(IDX)[..., : cfg.vocab_size]).abs().max() > 1e-3
    for bad in ({k: 0 for k in (*SHAPE, "q_lora_rank")}, dict(rope_type="llama3")):
        with pytest.raises(ValueError, match="--rope-mscale-all-dim 1.0 .DeepSeek's YaRN. needs"):
            dataclasses.replace(cfg, **bad).validate()


def test_an_interleaved_deepseek_v3_reads_as_the_same_model():
    cfg = ds_cfg(**MOE)
    ours = random_model(cfg)
    theirs = hf_weights.to_hf(state(ours), cfg)
    config = copy.deepcopy(theirs.config)
    config.rope_interleave = True
    logits = []
    for permute in (True, False):
        inter = transformers.DeepseekV3ForCausalLM(config).eval()
        sd = theirs.state_dict()
        if permute:  # DeepSeek's layout: the rotary rows of W_qb and W_kva interleaved
            for name, t in sd.items():
                for ours_name, hf in hf_deepseek.ATTENTION.items():
                    if name.endswith(f"self_attn.{hf}.weight"):
                        sd[name] = hf_deepseek.interleaved(ours_name, t, cfg)
        inter.load_state_dict(sd)
        _, back = hf_weights.from_hf(inter)
        mine = GPT(cfg, seed=0).eval()
        mine.load_state_dict(back)
        with torch.no_grad():
            logits.append(mine(IDX)[..., : cfg.vocab_size])
            if permute:
                assert (inter(IDX).logits - logits[-1]).abs().max() < 1e-4
    with torch.no_grad():
        want = ours(IDX)[..., : cfg.vocab_size]
    assert (logits[0] - want).abs().max() < 1e-4
    assert (logits[1] - want).abs().max() > 1e-3  # read without the permutation: another model


def test_balance_loss_is_deepseek_v3_sequence_wise_loss():
    """Eq. 17-20: L = alpha sum_i f_i P_i, f_i = E / (k T) sum_t 1(i chosen for t), P_i = mean_t of
    s_i,t / sum_j s_j,t, over one sequence of T tokens."""
    E, k, T = 8, 2, 24
    logits = torch.randn(3 * T, E, generator=torch.Generator().manual_seed(0))
    _, experts, probs = moe.route(logits, k, "deepseek_v3", torch.zeros(E), (4, 2), 2.5)
    s = logits.sigmoid().view(3, T, E)
    chosen = torch.zeros(3, T, E).scatter(2, experts.view(3, T, k), 1.0)
    f = E / (k * T) * chosen.sum(1)  # (b, E)
    P = (s / s.sum(-1, keepdim=True)).mean(1)  # (b, E)
    paper = (f * P).sum(-1)
    ours = moe.balance_loss(probs.view(3, T, E), experts.view(3, T, k), E)
    torch.testing.assert_close(ours, paper, rtol=1e-6, atol=0)
    hf_cfg = hf_deepseek.hf_model(ds_cfg(**MOE))[0]
    assert hf_cfg.aux_loss_alpha == 1e-3  # moe_aux_loss, unchanged, under DeepSeek's name
    assert hf_deepseek.deepseek_v3_config(hf_cfg.to_dict()).moe_aux_loss == 1e-3


def test_what_deepseek_v3_nanomega_cannot_compute_is_one_line():
    c = hf_deepseek.hf_model(ds_cfg(**MOE))[0].to_dict()
    for bad, match in (
        (dict(norm_topk_prob=False), "norm_topk_prob false"),
        (dict(rms_norm_eps=1e-5), "rms_norm_eps"),
        (dict(attention_bias=True), "attention_bias"),
    ):
        with pytest.raises(ValueError, match=match) as e:
            hf_deepseek.deepseek_v3_config(c | bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--router deepseek_v3"):
        hf_weights.hf_model(
            ds_cfg(**{**MOE, "router": "softmax_topk", "n_group": 1, "topk_group": 1})
        )


def test_deepseek_v3_folder_through_the_hf_command_line(tmp_path):
    """A DeepSeek-V3 folder (MoE, a random routing bias) imported by `nanomega.tools.hf import`:
    the checkpoint holds its weights bitwise and its biases in the routing table (moe.bias_table);
    exported back, the folder has the same tensors (biases included) and logits, bitwise."""
    from nanomega import checkpoint, reshard
    from nanomega.tools import hf

    cfg = ds_cfg(**MOE)
    theirs = hf_weights.to_hf(state(random_model(cfg)), cfg)
    src, out, dst = tmp_path / "src", tmp_path / "ckpt", tmp_path / "dst"
    theirs.save_pretrained(src)
    hf.main(["import", str(src), "--out-dir", str(out)])
    _, back = hf_weights.from_hf(theirs)
    saved = reshard.full_weights(checkpoint.latest(out))
    biases = {k: back.pop(k) for k in list(back) if k.endswith("expert_bias")}
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in back)
    table = checkpoint.load_shard(checkpoint.latest(out), 0)["moe_bias"]
    assert biases and all(torch.equal(table[int(k.split(".")[1])], b) for k, b in biases.items())

    hf.main(["export", "--out-dir", str(out), "--to", str(dst)])
    again = type(theirs).from_pretrained(dst, local_files_only=True).eval()
    want, got = theirs.state_dict(), again.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(again(IDX).logits, theirs(IDX).logits)


def test_mtp_modules_travel_as_deepseeks_layers(tmp_path):
    """The MTP modules (D 2) exported as DeepSeek's checkpoint holds them, model.layers.{L + d}.*
    (enorm, hnorm, eh_proj, the block, shared_head.norm, and copies of the shared embedding and
    head), and imported back: every name and shape as DeepSeek's, every weight bitwise.
    transformers' class itself holds no MTP module: it reports them as unexpected and skips them."""
    from safetensors.torch import load_file

    from nanomega import checkpoint, reshard
    from nanomega.tools import hf

    cfg = ds_cfg(mtp_num_layers=2)
    weights = {k: v.detach() for k, v in random_model(cfg).named_parameters()}
    out, dst, again = tmp_path / "ckpt", tmp_path / "dst", tmp_path / "again"
    hf.save_dense(out, cfg, weights, {})
    hf.main(["export", "--out-dir", str(out), "--to", str(dst)])

    # DeepSeek's names, each the tensor of ours it maps to
    got, L = load_file(dst / "model.safetensors"), cfg.n_layer
    for d in range(2):
        mine, theirs = weights, f"model.layers.{L + d}."  # (weights: ours)
        for ours, name in hf_deepseek.MTP.items():
            assert torch.equal(got[theirs + name], mine[f"mtp.depths.{d}.{ours}"])
        q_b = mine[f"mtp.depths.{d}.block.attn.q_b_proj.weight"]
        assert torch.equal(got[theirs + "self_attn.q_b_proj.weight"], q_b)
        assert torch.equal(
            got[theirs + "mlp.down_proj.weight"], mine[f"mtp.depths.{d}.block.mlp.c_proj.weight"]
        )
        assert torch.equal(got[theirs + "embed_tokens.weight"], got["model.embed_tokens.weight"])
        assert torch.equal(got[theirs + "shared_head.head.weight"], got["lm_head.weight"])
    assert not any(k.startswith(f"model.layers.{L + 2}.") for k in got)

    # transformers skips them (unexpected); our import reads them back, bitwise
    with hf_check_quiet():
        _, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
            dst, local_files_only=True, output_loading_info=True
        )
    mtp = {k for k in got if hf_deepseek.mtp_layer(k, L) >= 0}
    # per module: its 4, the 2 copies, 2 norms, 7 of attention, 3 of the MLP
    assert len(mtp) == 2 * 18 and set(info["unexpected_keys"]) == mtp
    hf.main(["import", str(dst), "--out-dir", str(again)])
    saved = reshard.full_weights(checkpoint.latest(again))
    rows = {"embed.wte.weight": cfg.vocab_size, "head.lm_head.weight": cfg.vocab_size}
    assert saved.keys() == weights.keys() and any(k.startswith("mtp.") for k in saved)
    assert all(torch.equal(saved[k][: rows.get(k)], weights[k][: rows.get(k)]) for k in weights)


def hf_check_quiet():
    from nanomega.tools import hf_check

    return hf_check.quiet(transformers)


def test_the_released_deepseek_v3_config(tmp_path):
    """deepseek-ai/DeepSeek-V3's config.json (its fields as released): refused in one line for its
    FP8 weights; dequantized (no quantization_config), read with its YaRN (factor 40 over 4,096,
    mscale = mscale_all_dim = 1) and its shape; an MoE MTP module in a folder is skipped, as
    transformers skips it."""
    import json

    from nanomega.tools import hf

    released = dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        num_nextn_predict_layers=1,
        first_k_dense_replace=3,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        seq_aux=True,
        aux_loss_alpha=0.001,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_theta=10000,
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
        moe_layer_freq=1,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=4096,
        ),
        quantization_config=dict(
            quant_method="fp8",
            fmt="e4m3",
            activation_scheme="dynamic",
            weight_block_size=[128, 128],
        ),
    )
    (tmp_path / "config.json").write_text(json.dumps(released))
    with pytest.raises(ValueError) as e:
        hf.hf_config(tmp_path)
    line = str(e.value)
    assert "\n" not in line and "config.json" in line and "quantization_config" in line
    del released["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(released))
    _, cfg = hf.hf_config(tmp_path)
    assert (cfg.rope_type, cfg.rope_scaling, cfg.rope_original_context) == ("yarn", 40.0, 4096)
    assert cfg.rope_mscale_all_dim == 1.0 and cfg.mla_score_scale == (0.1 * math.log(40) + 1) ** 2
    assert (cfg.n_layer, cfg.kv_lora_rank, cfg.first_k_dense, cfg.dense_ffn) == (61, 512, 3, 18432)
    assert (cfg.n_experts, cfg.top_k, cfg.n_group, cfg.topk_group) == (256, 8, 8, 4)
    bad = dict(released["rope_scaling"], mscale=0.5)
    (tmp_path / "config.json").write_text(json.dumps(released | dict(rope_scaling=bad)))
    with pytest.raises(ValueError, match="mscale 0.5, mscale_all_dim 1.0"):
        hf.hf_config(tmp_path)

    # its MTP module (model.layers.61.*) holds an MoE block: skipped with a reason
    found = {"model.layers.61.eh_proj.weight": ((7168, 14336), "f")}
    assert hf_deepseek.mtp_depths(released, found)[0] == 0
    assert "MoE" in hf_deepseek.mtp_depths(released, found)[1]
    dense = released | dict(first_k_dense_replace=62)
    assert hf_deepseek.mtp_depths(dense, found) == (1, None)
