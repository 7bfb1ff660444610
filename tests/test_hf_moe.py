"""Issue 48: Qwen2-MoE, Qwen3-MoE and OLMoE in and out (tools/hf_moe.py), beside Mixtral
(tests/test_moe.py).

Claims (one process; transformers builds the model offline from a small random config):
    logits    nanomega's MoE Llama with --shared-expert-gate as a transformers Qwen2MoeForCausalLM:
              logits within 1e-4 (fp32, the same math in another order) for both of Qwen's routers
              (norm_topk_prob false: softmax_topk; true: softmax_topk_norm), and back: the config's
              every routing field and every weight bitwise
    folder    its save_pretrained folder imported by `nanomega.tools.hf import` (every config field
              and tensor checked) into a checkpoint holding its weights bitwise, exported back by
              `export` as a Qwen2-MoE with the same logits
    refused   what nanomega cannot compute (Qwen2-MoE's default qkv biases, dense layers) is one line
    Qwen3-MoE QK-norm per head, the first block dense (mlp_only_layers [0], --first-k-dense 1): logits
              within 1e-4 both ways for both routers, and the other router's logits > 1e-3 off
    OLMoE     QK-norm over the whole q and k projections (--qk-norm-whole): logits within 1e-4 both
              ways for both routers; Qwen3's per-head norm with the same weights > 1e-3 off
"""

import dataclasses

import pytest
import torch

from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT

transformers = pytest.importorskip("transformers", reason="the test extra: transformers")
from nanomega.tools import hf_moe, hf_weights  # noqa: E402  (needs transformers)


def qwen_cfg(router):
    return GPTConfig(
        vocab_size=200,
        block_size=32,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=32,
        ffn_hidden=24,
        arch="llama",
        n_experts=8,
        top_k=2,
        router=router,
        shared_experts=2,
        shared_expert_gate=True,
        tie_embeddings=False,
        attention="eager",
        norm_eps=1e-6,
    )


def random_model(cfg):
    """Our model with matrices of std 0.1 and norm scales 1 +- 0.1: the routing and the gate far
    from uniform, logits of size ~1 (the 1e-4 bound is relative to them)."""
    ours = GPT(cfg, seed=3).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        for p in ours.parameters():
            p.copy_((p.dim() == 1) + 0.1 * torch.randn(p.shape, generator=g))
    return ours


IDX = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("router", ["softmax_topk", "softmax_topk_norm"])
def test_qwen2_moe_round_trip_logits(router):
    cfg = qwen_cfg(router)
    ours = random_model(cfg)
    weights = {k: v.detach() for k, v in ours.named_parameters()}
    theirs = hf_weights.to_hf(weights, cfg)
    assert type(theirs).__name__ == "Qwen2MoeForCausalLM"
    with torch.no_grad():
        got, want = theirs(IDX).logits, ours(IDX)[..., : cfg.vocab_size]
    assert (got - want).abs().max().item() < 1e-4
    assert theirs.config.norm_topk_prob == (router == "softmax_topk_norm")

    cfg2, back = hf_moe.from_hf(theirs)
    for key in ("router", "n_experts", "top_k", "shared_experts", "shared_expert_gate", "ffn"):
        assert getattr(cfg2, key) == getattr(cfg, key), key
    assert cfg2.moe_aux_loss == pytest.approx(cfg.moe_aux_loss, rel=1e-12)
    rows = {"embed.wte.weight": cfg.vocab_size, "head.lm_head.weight": cfg.vocab_size}
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k][: rows.get(k)], w[: rows.get(k)]) for k, w in weights.items())


def test_what_qwen2_moe_nanomega_cannot_compute_is_one_line():
    c = transformers.Qwen2MoeConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2
    ).to_dict()
    with pytest.raises(ValueError, match="qkv_bias true") as e:
        hf_moe.qwen2_moe_config(c)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="dense layers"):
        hf_moe.qwen2_moe_config(c | dict(qkv_bias=False, mlp_only_layers=[1]))


def test_qwen2_moe_folder_through_the_hf_command_line(tmp_path, capsys):
    from nanomega import checkpoint, reshard
    from nanomega.tools import hf

    cfg = qwen_cfg("softmax_topk")
    theirs = hf_weights.to_hf({k: v.detach() for k, v in random_model(cfg).named_parameters()}, cfg)
    src, out, dst = tmp_path / "src", tmp_path / "ckpt", tmp_path / "dst"
    theirs.save_pretrained(src)
    hf.main(["import", str(src), "--out-dir", str(out)])
    # the command it prints routes as the model does (--router default: mixtral)
    assert "--router softmax_topk " in capsys.readouterr().out
    manifest = checkpoint.read_manifest_json(checkpoint.latest(out))
    assert manifest["layout"]["router"] == "softmax_topk"  # a resume under mixtral: refused
    _, back = hf_moe.from_hf(theirs)
    saved = reshard.full_weights(checkpoint.latest(out))
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in back)

    hf.main(["export", "--out-dir", str(out), "--to", str(dst)])
    again = transformers.Qwen2MoeForCausalLM.from_pretrained(dst, local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(again(IDX).logits, theirs(IDX).logits)


def qwen3_cfg(router, first_k_dense=1):
    """A Qwen3-MoE: QK-norm, no shared experts, the first block dense (mlp_only_layers [0])."""
    return dataclasses.replace(
        qwen_cfg(router),
        n_layer=3,
        shared_experts=0,
        shared_expert_gate=False,
        qk_norm=True,
        first_k_dense=first_k_dense,
        dense_ffn_hidden=40,
    )


@pytest.mark.parametrize("router", ["softmax_topk", "softmax_topk_norm"])
def test_qwen3_moe_round_trip_logits_and_its_router(router):
    """Qwen3-MoE both ways, logits within 1e-4 (fp32); the same weights routed by the other
    convention (norm_topk_prob flipped) differ by > 1e-3: the test tells the routers apart."""
    cfg = qwen3_cfg(router)
    ours = random_model(cfg)
    weights = {k: v.detach() for k, v in ours.named_parameters()}
    theirs = hf_weights.to_hf(weights, cfg)
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    assert theirs.config.mlp_only_layers == [0] and theirs.config.intermediate_size == 40
    other = "softmax_topk" if router == "softmax_topk_norm" else "softmax_topk_norm"
    flipped = GPT(qwen3_cfg(other), seed=3).eval()
    flipped.load_state_dict(ours.state_dict())
    with torch.no_grad():
        got, want = theirs(IDX).logits, ours(IDX)[..., : cfg.vocab_size]
        wrong = flipped(IDX)[..., : cfg.vocab_size]
    assert (got - want).abs().max().item() < 1e-4
    assert (got - wrong).abs().max().item() > 1e-3

    cfg2, back = hf_weights.from_hf(theirs)
    assert cfg2 == dataclasses.replace(cfg, attention="eager", moe_aux_loss=cfg2.moe_aux_loss)
    assert cfg2.moe_aux_loss == pytest.approx(cfg.moe_aux_loss, rel=1e-12)
    rows = {"embed.wte.weight": cfg.vocab_size, "head.lm_head.weight": cfg.vocab_size}
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k][: rows.get(k)], w[: rows.get(k)]) for k, w in weights.items())


def test_what_qwen3_moe_nanomega_cannot_compute_is_one_line():
    c = hf_moe.hf_model(qwen3_cfg("softmax_topk"))[0].to_dict()
    with pytest.raises(ValueError, match="dense layers") as e:
        hf_moe.qwen3_moe_config(c | dict(mlp_only_layers=[1]))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no shared experts"):
        hf_moe.hf_model(dataclasses.replace(qwen3_cfg("softmax_topk"), shared_experts=1))


def olmoe_cfg(router):
    """An OLMoE: RMSNorm over the whole q and k projections, no shared experts, every block MoE."""
    return dataclasses.replace(
        qwen3_cfg(router, first_k_dense=0), qk_norm=False, qk_norm_whole=True, dense_ffn_hidden=0
    )


@pytest.mark.parametrize("router", ["softmax_topk", "softmax_topk_norm"])
def test_olmoe_round_trip_logits(router):
    """OLMoE both ways, logits within 1e-4 (fp32); the same weights with Qwen3's per-head QK-norm
    (the norms' scales cut to a head) differ by > 1e-3: the whole-projection norm is told apart."""
    cfg = olmoe_cfg(router)
    ours = random_model(cfg)
    weights = {k: v.detach() for k, v in ours.named_parameters()}
    theirs = hf_weights.to_hf(weights, cfg)
    assert type(theirs).__name__ == "OlmoeForCausalLM"
    per_head = GPT(dataclasses.replace(cfg, qk_norm=True, qk_norm_whole=False), seed=3).eval()
    hd = cfg.n_embd // cfg.n_head
    per_head.load_state_dict(
        {k: v[:hd] if "_norm." in k else v for k, v in ours.state_dict().items()}
    )
    with torch.no_grad():
        got, want = theirs(IDX).logits, ours(IDX)[..., : cfg.vocab_size]
        wrong = per_head(IDX)[..., : cfg.vocab_size]
    assert (got - want).abs().max().item() < 1e-4
    assert (got - wrong).abs().max().item() > 1e-3

    cfg2, back = hf_weights.from_hf(theirs)
    assert cfg2 == dataclasses.replace(cfg, moe_aux_loss=cfg2.moe_aux_loss)
    assert cfg2.moe_aux_loss == pytest.approx(cfg.moe_aux_loss, rel=1e-12)
    rows = {"embed.wte.weight": cfg.vocab_size, "head.lm_head.weight": cfg.vocab_size}
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k][: rows.get(k)], w[: rows.get(k)]) for k, w in weights.items())


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe"])
def test_qwen3_moe_and_olmoe_folders_through_the_hf_command_line(tmp_path, kind):
    """Each folder imported by `nanomega.tools.hf import` (every config field and tensor shape
    checked: Qwen3-MoE's dense first block, OLMoE's whole-projection norms) into a checkpoint
    holding its weights bitwise, exported back with the same logits, bitwise."""
    from nanomega import checkpoint, reshard
    from nanomega.tools import hf

    cfg = qwen3_cfg("softmax_topk_norm") if kind == "qwen3_moe" else olmoe_cfg("softmax_topk")
    theirs = hf_weights.to_hf({k: v.detach() for k, v in random_model(cfg).named_parameters()}, cfg)
    src, out, dst = tmp_path / "src", tmp_path / "ckpt", tmp_path / "dst"
    theirs.save_pretrained(src)
    hf.main(["import", str(src), "--out-dir", str(out)])
    _, back = hf_weights.from_hf(theirs)
    saved = reshard.full_weights(checkpoint.latest(out))
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in back)

    hf.main(["export", "--out-dir", str(out), "--to", str(dst)])
    again = type(theirs).from_pretrained(dst, local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(again(IDX).logits, theirs(IDX).logits)
