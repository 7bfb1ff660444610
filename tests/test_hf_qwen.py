"""Qwen2/Qwen2.5 (q, k, v biases; tied and untied), Qwen3 (QK-norm) and the RoPE scaling rules, in
and out of transformers; then the biased and QK-normed blocks under tp2 equal to the dense ones.

HF: small random configs built here (no download), weights at scale (embedding N(0, 1), matrices
N(0, 1/fan_in), biases N(0, 1), norm scales 1 +- 0.2), so a bias, a norm or a rotation left out
moves the logits by far more than the bound. Tolerance: 1e-4 on logits up to ~35 (the issue's
bound; the same fp32 operations in another order (transformers' sdpa against our eager core) differ by
~1e-6: measured 9.5e-6 on the tied Qwen2's logits of 34, 0 to 2.2e-6 on the RoPE models).
RoPE: each rule's inverse frequencies and attention factor against transformers' own
ROPE_INIT_FUNCTIONS for a sequence of 320 tokens, longer than the original context (256; dynamic:
max_position_embeddings 256): equal up to one fp32 rounding of each frequency (rtol 2^-22); then
the logits of a model at those 320 tokens, and the same weights without the scaling differ
(> 1e-2).
tp2: the layouts of tests/test_llama.py's tolerance (layout_rtol), 4 steps; the biases and norm scales
start at 0 and 1 and move, so their gradients under tp (split with q, k, v; summed over tp for the
replicated k/v group and the norm scales) are in the comparison; the weights come back through
resharding (reshard.full_weights of the tp2 checkpoint).
"""

import dataclasses

import pytest
import torch

pytest.importorskip(
    "transformers", reason="the hf extra (transformers, safetensors) is not installed"
)
import transformers  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from nanomega import checkpoint, reshard, train, worlds  # noqa: E402
from nanomega.model import GPT  # noqa: E402
from nanomega.modern import rope_frequencies  # noqa: E402
from nanomega.tools import hf, hf_weights  # noqa: E402
from test_layouts import curve, flags, run_layouts  # noqa: E402
from test_llama import COMMON, RTOL  # noqa: E402

SMALL = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
QWEN = {  # name: (model class, config class, fields)
    "qwen2-tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen2-untied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(tie_word_embeddings=False)),
}
# RoPE: head size 32 and an original context of 256, so each rule's bands fall between dimensions
# (YaRN's ramp runs from dimension 0 to 7 of 16: its beta_fast and beta_slow both matter)
ROPE_SHAPE = dict(hidden_size=128, head_dim=32, max_position_embeddings=256)
ROPE = {  # name: rope_scaling (original context 256 < S; dynamic: max_position_embeddings 256)
    "llama3": dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=256,
    ),
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256),
}
S = 320


def random_model(model_class, config_class, seed=0, **fields):
    """A random transformers model at scale (see the top), in eval mode."""
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**SMALL, **fields})
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
    return model.eval()


def logits(model, idx):
    with torch.no_grad():
        out = model(idx)
    return (out.logits if hasattr(out, "logits") else out)[..., :300]


@pytest.mark.parametrize("name", QWEN)
def test_qwen_logits_both_ways(name, tmp_path):
    model_class, config_class, fields = QWEN[name]
    ref_model = random_model(model_class, config_class, **fields)
    ref_model.save_pretrained(tmp_path / "src")
    idx = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    ref = logits(ref_model, idx)

    # in: the folder (every field and tensor checked), and the model in memory
    mine = hf.load_pretrained(tmp_path / "src")
    cfg = mine.cfg
    assert (cfg.qkv_bias, cfg.qk_norm) == (name.startswith("qwen2"), name == "qwen3")
    assert cfg.tie_embeddings == fields["tie_word_embeddings"]
    diff = (logits(mine, idx) - ref).abs().max().item()
    print(f"{name}: max |logit diff| {diff:.2e} (logits up to {ref.abs().max().item():.1f})")
    assert diff < 1e-4
    assert hf_weights.from_hf(ref_model)[0] == cfg

    # out: the same class, every weight bitwise, transformers' logits from the saved folder
    back = hf_weights.to_hf(mine.state_dict(), cfg)
    assert type(back).__name__ == model_class
    theirs, ours = ref_model.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    back.save_pretrained(tmp_path / "back")
    loaded = getattr(transformers, model_class).from_pretrained(tmp_path / "back")
    assert (logits(loaded.eval(), idx) - ref).abs().max() < 1e-4

    # the bias or the norm is in play: without it the logits move
    key = "attn.q_proj.bias" if cfg.qkv_bias else "attn.q_norm.weight"
    state = {k: (t.zero_() if key in k else t) for k, t in mine.state_dict().items()}
    mine.load_state_dict(state)
    assert (logits(mine, idx) - ref).abs().max() > 1e-2


def test_an_unknown_model_type_is_one_line():
    """Issue 51: hf_weights.from_hf of a model it does not know fell into the GPT-2 branch
    (AttributeError on a missing n_inner)."""
    config = transformers.MistralConfig(**SMALL)
    with pytest.raises(ValueError, match=r"^model_type 'mistral': nanomega reads gpt2, llama"):
        hf_weights.from_hf(transformers.MistralForCausalLM(config))


@pytest.mark.parametrize("rule", ROPE)
def test_rope_rule_against_transformers(rule):
    fields = dict(ROPE_SHAPE, rope_scaling=ROPE[rule])
    config = transformers.LlamaConfig(**SMALL | fields, rope_theta=10000.0)
    theirs, their_factor = ROPE_INIT_FUNCTIONS[rule](config, "cpu", seq_len=S)
    cfg = hf_weights.llama_config(config.to_dict())
    assert cfg.rope_type == rule and cfg.rope_scaling == ROPE[rule]["factor"]
    original = cfg.rope_original_context  # (linear has none: every position alike)
    assert original == {"linear": 8192}.get(rule, 256)
    ours, factor = rope_frequencies(32, 10000.0, cfg.rope_scaling, rule, original, seq=S)
    torch.testing.assert_close(ours, theirs, rtol=2**-22, atol=0)
    assert factor == pytest.approx(their_factor, rel=1e-12)
    assert not torch.equal(ours, rope_frequencies(32, 10000.0)[0])  # the rule changed them

    # a model at S tokens: transformers' logits, and not those of the unscaled rotation
    ref_model = random_model("LlamaForCausalLM", "LlamaConfig", **fields)
    ref_model.config._attn_implementation = "eager"
    idx = torch.randint(0, 300, (1, S), generator=torch.Generator().manual_seed(2))
    cfg, weights = hf_weights.from_hf(ref_model)
    mine = GPT(cfg, seed=0).eval()
    mine.load_state_dict(weights)
    ref = logits(ref_model, idx)
    diff = (logits(mine, idx) - ref).abs().max().item()
    print(f"{rule}: max |logit diff| {diff:.2e} at {S} tokens (logits up to {ref.abs().max():.1f})")
    assert diff < 1e-4
    plain = GPT(dataclasses.replace(cfg, rope_scaling=1.0), seed=0).eval()
    plain.load_state_dict(weights)
    assert (logits(plain, idx) - ref).abs().max() > 1e-2

    # and back out: transformers reads the same rule
    back = hf_weights.to_hf(mine.state_dict(), cfg)
    assert (logits(back, idx) - ref).abs().max() < 1e-4


# ---------------------------------------------------------------- tp2 = dense, with biases
LAYOUTS = [  # (name, flags of the block, the layout); global batch 8
    ("qwen2-tp2", ["--qkv-bias"], ["--tp", "2"]),
    # one key/value head for two ranks: tp.GroupKeyValue's whole weight and bias, under SP
    ("qwen2-kv1-tp2-sp", ["--qkv-bias", "--n-kv-head", "1"], ["--tp", "2", "--sequence-parallel"]),
    ("qwen3-tp2", ["--qk-norm"], ["--tp", "2"]),
]
BATCH = ["--batch-size", "2", "--grad-accum", "4"]
CORPUS_CHARS = 200_000


def test_tp2_equals_dense_with_biases_and_qk_norm(corpus, tmp_path):
    layouts = [(name, block + layout + BATCH) for name, block, layout in LAYOUTS]
    worlds.launch(run_layouts, 2, corpus, tmp_path, layouts, None, COMMON, timeout=600)
    for name, block, _ in LAYOUTS:
        dense = tmp_path / f"dense-{name}"
        train.main(flags(corpus, dense, block + BATCH, COMMON))
        (losses, val), (ref, ref_val) = curve(tmp_path / name), curve(dense)
        assert losses == pytest.approx(ref, rel=RTOL) and val == pytest.approx(ref_val, rel=RTOL)

        # the weights, resharded from tp2 into one process; the biases / norm scales have moved
        a = reshard.full_weights(checkpoint.latest(tmp_path / name))
        b = reshard.full_weights(checkpoint.latest(dense))
        key = (
            "blocks.0.attn.kv_proj.bias" if "--qkv-bias" in block else "blocks.0.attn.k_norm.weight"
        )
        assert a.keys() == b.keys() and b[key].sub(0.0 if "bias" in key else 1.0).abs().max() > 1e-3
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")
