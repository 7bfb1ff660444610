"""Issue 48: Qwen2-MoE in and out (tools/hf_moe.py), beside Mixtral (tests/test_moe.py).

Claims (one process; transformers builds the model offline from a small random config):
    logits    nanomega's MoE Llama with --shared-expert-gate as a transformers Qwen2MoeForCausalLM:
              logits within 1e-4 (fp32, the same math in another order) for both of Qwen's routers
              (norm_topk_prob false: softmax_topk; true: softmax_topk_norm), and back: the config's
              every routing field and every weight bitwise
    folder    its save_pretrained folder imported by `nanomega.tools.hf import` (every config field
              and tensor checked) into a checkpoint holding its weights bitwise, exported back by
              `export` as a Qwen2-MoE with the same logits
    refused   what nanomega cannot compute (Qwen2-MoE's default qkv biases, dense layers) is one line
"""

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
    """Our model with weights of std 0.1: the routing and the gate far from uniform."""
    ours = GPT(cfg, seed=3).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        for p in ours.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
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
