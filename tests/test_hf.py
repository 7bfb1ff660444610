"""HF GPT-2 and Llama in and out (nanomega/tools/hf.py): models built here (no download) are
imported, fine-tuned dense and under tp=2, sampled, exported and loaded back by transformers.

Tolerance: nanomega and transformers run the same fp32 operations in a different order (GPT-2:
Conv1D's addmm vs F.linear, HF's attention vs ours), so logits differ by fp32 rounding accumulated
over 2 layers: ~1e-6 of logits of size ~1; the issue's bound 1e-4 leaves 100x. (Llama: transformers
5.23's eager path runs our operations in our order, measured 0.0 on logits up to ~70; the bound is
kept for other versions.) The vocabulary is 4,001 (the first 4,000 ranks of shakespeare-4k +
<|endoftext|>), padded to 4,096 in nanomega: the padded rows are in play, and the HF loss is only
equal if they are masked out of the softmax.
Llama shapes: GQA (4 query / 2 key-value heads, untied, rope_theta 500,000), a tied head with 9
query / 3 key-value heads, and Llama 3.1's RoPE scaling (factor 8) on 512 tokens, where it changes
the logits by ~0.1 (the test checks that it does). Their weights are drawn at scale (embedding N(0,
1), matrices N(0, 1/fan_in), norm scales 1 +- 0.2) rather than transformers' std 0.02, so attention
is far from uniform and a wrong rotation, head grouping or row order would show.
"""

import dataclasses
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "transformers", reason="the hf extra (transformers, safetensors) is not installed"
)
import transformers  # noqa: E402

from nanomega import data, train, worlds  # noqa: E402
from nanomega.model import GPT  # noqa: E402
from nanomega.tools import hf, hf_weights, sample, tokenizer

# (this file's llama_config builds HF's)
from nanomega.tools.hf_llama import llama_config as gpt_config_of

ROOT = Path(__file__).resolve().parent.parent
V = 4001
SMALL = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--eval-every",
    "0",
    "--warmup",
    "1",
    "--peak-flops",
    "1e11",
    "--log-every",
    "100",
    "--max-steps",
    "2",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random GPT-2 in transformers' format with a 4,001-token tokenizer, and a small corpus."""
    root = tmp_path_factory.mktemp("hf")
    ranks = data.get_tokenizer("shakespeare-4k")._mergeable_ranks
    tok_file = root / "small.tiktoken"
    # a BPE prefix is a BPE
    tokenizer.save_ranks({t: r for t, r in ranks.items() if r < V - 1}, tok_file)
    enc = data.get_tokenizer(str(tok_file))
    assert enc.n_vocab == V
    torch.manual_seed(0)
    src = root / "gpt2-src"
    cfg = transformers.GPT2Config(
        vocab_size=V,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    transformers.GPT2LMHeadModel(cfg).save_pretrained(src)
    tokenizer.to_hf(enc).save_pretrained(src)
    corpus = root / "small.txt"
    corpus.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(100_000))
    return root, src, tok_file, corpus


def hf_logits(folder, idx):
    model = transformers.GPT2LMHeadModel.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        return model(idx).logits


def our_logits(out_dir, idx):
    model, _ = sample.load_model(out_dir)
    with torch.no_grad():
        return model(idx)[..., : model.cfg.vocab_size]


def exports_match(root, names, logits_of_hf, idx, ref, corpus, tok):
    """Export each fine-tuned layout: transformers loads it with nanomega's logits (and they moved
    from `ref`: the test can tell the models apart); the exported tokenizer encodes as ours."""
    for name in names:
        out, to = root / name, root / f"{name}-hf"
        assert hf.export(out, to) == (to, True)
        assert (to / "config.json").is_file() and (to / "model.safetensors").is_file()
        mine = our_logits(out, idx)
        assert (logits_of_hf(to, idx) - mine).abs().max() < 1e-4
        assert (mine - ref).abs().max() > 1e-3
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(root / f"{names[-1]}-hf")
    text = corpus.read_text()[:3000]
    assert fast.encode(text) == data.get_tokenizer(tok).encode_ordinary(text)


def run_tp2(corpus, out, tok):
    train.main(
        [
            *SMALL,
            "--tp",
            "2",
            "--corpus",
            str(corpus),
            "--tokenizer",
            tok,
            "--out-dir",
            str(out),
            "--data-cache",
            str(out.parent / "cache"),
            "--resume",
        ]
    )
    return True


def test_import_finetune_tp2_sample_export(setup):
    root, src, tok_file, corpus = setup
    idx = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(1))
    imported = root / "imported"
    cfg, tok = hf.import_(src, imported)
    assert (cfg.vocab_size, cfg.padded_vocab_size, cfg.n_layer) == (V, 4096, 2)
    # tokenizer.json -> .tiktoken, byte for byte
    assert Path(tok).read_bytes() == tok_file.read_bytes()
    ref = hf_logits(src, idx)
    assert (our_logits(imported, idx) - ref).abs().max() < 1e-4  # see the top: fp32 rounding ~1e-6

    # GPT-2's own loss (over 4,001 tokens) is nanomega's loss: the padded rows are masked out
    model, _ = sample.load_model(imported)
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(src, local_files_only=True)
    with torch.no_grad():
        assert (
            abs(model(idx[:, :-1], idx[:, 1:]).item() - hf_model(idx, labels=idx).loss.item())
            < 1e-5
        )

    # fine-tune the import dense and under tp=2 (resharded on load): the same losses
    runs = {}
    for name in ("dense", "tp2"):
        out = root / name
        (out / "ckpt").mkdir(parents=True)
        shutil.copytree(imported / "ckpt" / "step_000000", out / "ckpt" / "step_000000")
        (out / "ckpt" / "latest").write_text("step_000000")
        if name == "dense":
            train.main(
                [
                    *SMALL,
                    "--corpus",
                    str(corpus),
                    "--tokenizer",
                    tok,
                    "--out-dir",
                    str(out),
                    "--data-cache",
                    str(root / "cache"),
                    "--resume",
                ]
            )
        else:
            worlds.launch(run_tp2, 2, corpus, out, tok, timeout=240)
        runs[name] = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]
    # fp32 order
    assert len(runs["dense"]) == 2 and runs["tp2"] == pytest.approx(runs["dense"], rel=1e-5)

    exports_match(root, ("dense", "tp2"), hf_logits, idx, ref, corpus, tok)

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanomega.tools.sample",
            "--out-dir",
            str(root / "tp2"),
            "--max-new-tokens",
            "20",
            "--prompt",
            "ROMEO:",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0 and out.stdout.startswith("ROMEO:"), out.stderr[-2000:]


def test_not_gpt2_is_refused_in_one_line(setup, tmp_path):
    root, src, _, _ = setup
    out = tmp_path / "alibi"
    hf.import_(src, out)
    manifest = out / "ckpt" / "step_000000" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["config"]["alibi"] = True
    manifest.write_text(json.dumps(m))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanomega.tools.hf",
            "export",
            "--out-dir",
            str(out),
            "--to",
            str(tmp_path / "x"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "ALiBi" in res.stderr, res.stderr
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- Llama
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
SHAPES = {  # name: (LlamaConfig fields, tokens per sequence)
    "gqa-untied": (
        dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0),
        32,
    ),
    "tied-9q-3kv": (
        dict(
            hidden_size=72, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True
        ),
        32,
    ),
    "llama3-rope": (
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_ROPE,
            max_position_embeddings=16384,
        ),
        512,
    ),
}
CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
)


def llama_config(**fields):
    base = dict(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    return transformers.LlamaConfig(**{**base, **fields})


def save_llama(folder, seed=0, **fields):
    """A random LlamaForCausalLM with weights at scale (see the top), saved to `folder`; returns it
    (eval)."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
    model.save_pretrained(folder)
    return model.eval()


def hf_llama(folder, idx):
    model = transformers.LlamaForCausalLM.from_pretrained(
        folder, local_files_only=True, attn_implementation="eager"
    )
    with torch.no_grad():
        return model.eval()(idx).logits


@pytest.mark.parametrize("shape", SHAPES)
def test_llama_logits_and_a_bitwise_round_trip(shape, tmp_path):
    fields, s = SHAPES[shape]
    ref_model = save_llama(tmp_path / "src", **fields)
    idx = torch.randint(0, 300, (2, s), generator=torch.Generator().manual_seed(1))
    ref = hf_llama(tmp_path / "src", idx)
    model = hf.load_pretrained(tmp_path / "src")
    assert model.cfg.arch == "llama" and model.cfg.tie_embeddings == shape.startswith("tied")
    # one parameter
    assert (model.head.lm_head.weight is model.embed.wte.weight) == model.cfg.tie_embeddings
    with torch.no_grad():
        mine = model.eval()(idx)[..., :300]
    diff = (mine - ref).abs().max().item()
    print(f"{shape}: max |logit diff| {diff:.2e} (logits up to {ref.abs().max().item():.1f})")
    assert diff < 1e-4

    # HF -> nanomega -> HF: every weight bitwise
    back = hf_weights.to_hf(model.state_dict(), model.cfg)
    theirs, ours = ref_model.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    # and every field of the config that shapes the model
    a, b = ref_model.config.to_dict(), back.config.to_dict()
    assert {k: a.get(k) for k in CONFIG_FIELDS} == {k: b.get(k) for k in CONFIG_FIELDS}
    back.save_pretrained(tmp_path / "back")
    assert (hf_llama(tmp_path / "back", idx) - ref).abs().max() < 1e-4

    # at 512 tokens Llama 3.1's scaling changes the rotation: it is tested
    if model.cfg.rope_scaling != 1.0:
        plain = GPT(dataclasses.replace(model.cfg, rope_scaling=1.0), seed=0)
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            unscaled = (plain.eval()(idx)[..., :300] - ref).abs().max().item()
        print(f"{shape}: the same weights without the scaling: max |logit diff| {unscaled:.2e}")
        assert unscaled > 1e-2


def test_llama_config_of_transformers_4_and_5():
    """transformers 4 writes rope_theta and rope_scaling at the top; 5 writes rope_parameters: the
    same GPTConfig."""
    v4 = dict(llama_config().to_dict(), rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
    del v4["rope_parameters"]
    v5 = llama_config(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE).to_dict()
    assert "rope_parameters" in v5 and gpt_config_of(v4) == gpt_config_of(v5)
    assert (gpt_config_of(v4).rope_scaling, gpt_config_of(v4).rope_theta) == (8.0, 500000.0)


def test_llama_import_finetune_tp2_sample_export(setup, capsys):
    """A Llama with our tokenizer: imported (tokenizer.json -> the same .tiktoken bytes), fine-tuned
    dense and under tp=2 with the flags import prints, sampled, exported; transformers reads the
    exports with our logits."""
    root, _, tok_file, corpus = setup
    src = root / "llama-src"
    save_llama(src, vocab_size=V, max_position_embeddings=32, rope_theta=500000.0)
    tokenizer.to_hf(data.get_tokenizer(str(tok_file))).save_pretrained(src)
    idx = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(1))
    imported = root / "llama-imported"
    cfg, tok = hf.import_(src, imported)
    assert (cfg.arch, cfg.vocab_size, cfg.padded_vocab_size, cfg.n_kv_head, cfg.tie_embeddings) == (
        "llama",
        V,
        4096,
        2,
        False,
    )
    # tokenizer.json -> .tiktoken, byte for byte
    assert Path(tok).read_bytes() == tok_file.read_bytes()
    ref = hf_llama(src, idx)
    assert (our_logits(imported, idx) - ref).abs().max() < 1e-4
    # transformers' loss over 4,001 tokens is ours: padded rows masked
    model, _ = sample.load_model(imported)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(
        src, local_files_only=True, attn_implementation="eager"
    )
    with torch.no_grad():
        assert (
            abs(model(idx[:, :-1], idx[:, 1:]).item() - hf_model(idx, labels=idx).loss.item())
            < 1e-5
        )

    # what `import` prints: train.py must accept it as this checkpoint's shape
    flags = hf.train_flags(cfg).split()
    assert flags[flags.index("--arch") + 1] == "llama" and "--untie-embeddings" in flags
    runs = {}
    for name in ("llama-dense", "llama-tp2"):
        out = root / name
        (out / "ckpt").mkdir(parents=True)
        shutil.copytree(imported / "ckpt" / "step_000000", out / "ckpt" / "step_000000")
        argv = [
            *SMALL,
            *flags,
            "--corpus",
            str(corpus),
            "--tokenizer",
            tok,
            "--out-dir",
            str(out),
            "--data-cache",
            str(root / "cache"),
            "--resume",
        ]
        if name == "llama-dense":
            train.main(argv)
        else:
            worlds.launch(train_tp2, 2, argv, timeout=240)
        runs[name] = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]
    assert len(runs["llama-dense"]) == 2 and runs["llama-tp2"] == pytest.approx(
        runs["llama-dense"], rel=1e-5
    )

    exports_match(root, ("llama-dense", "llama-tp2"), hf_llama, idx, ref, corpus, tok)
    capsys.readouterr()
    sample.main(
        ["--out-dir", str(root / "llama-tp2"), "--max-new-tokens", "20", "--prompt", "ROMEO:"]
    )
    assert capsys.readouterr().out.startswith("ROMEO:")


def train_tp2(argv):
    train.main([*argv, "--tp", "2"])
    return True


REFUSED = {  # name: (what config.json or tokenizer.json says, a word of the one line)
    "attention-bias": (dict(attention_bias=True), "attention_bias"),
    "mlp-bias": (dict(mlp_bias=True), "mlp_bias"),
    "activation": (dict(hidden_act="gelu"), "hidden_act 'gelu' (nanomega: silu)"),
    "head-dim": (
        dict(head_dim=16),
        "head_dim 16 (nanomega: hidden_size / num_attention_heads = 8)",
    ),
    "rope-type": (
        dict(
            rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 4, long_factor=[2.0] * 4)
        ),
        "rope_type 'longrope'",
    ),
    "yarn-mscale": (
        dict(
            rope_scaling=dict(
                rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=0.7
            )
        ),
        "mscale 0.7",
    ),
    "llama3-constants": (
        dict(rope_scaling=dict(LLAMA3_ROPE, low_freq_factor=2.0)),
        "low_freq_factor 2.0",
    ),
    "model-type": (
        "mistral",
        "model_type 'mistral' (nanomega: gpt2, llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3)",
    ),
    # a tokenizer.json not in GPT-2's layout is read by the tokenizers library (Llama 3's split:
    # tests/test_hf_tokenizer.py); one it cannot read is refused
    "broken-tokenizer": ({"type": "NoSuchPreTokenizer"}, "not a tokenizer.json"),
}


def test_truncated_weights_are_one_line_and_nothing_is_written(setup, tmp_path):
    """Issue 28, item 2: an import of a folder whose model.safetensors is truncated raised
    SafetensorError."""
    src = tmp_path / "src"
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(src)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: len(weights.read_bytes()) // 2])
    with pytest.raises(ValueError) as e:
        hf.import_(src, tmp_path / "out")
    assert f"{src}: its weights cannot be read" in str(e.value) and "\n" not in str(e.value), str(
        e.value
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", REFUSED)
def test_what_nanomega_cannot_compute_is_refused_in_one_line(case, setup, tmp_path):
    edit, words = REFUSED[case]
    src = tmp_path / "src"
    llama_config(**(edit if isinstance(edit, dict) and "type" not in edit else {})).save_pretrained(
        src
    )
    if case == "model-type":
        c = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(dict(c, model_type=edit)))
    # our tokenizer.json, its pre-tokenizer swapped
    if case.endswith("tokenizer"):
        tokenizer.to_hf(data.get_tokenizer("shakespeare-4k")).save_pretrained(src)
        spec = json.loads((src / "tokenizer.json").read_text())
        spec["pre_tokenizer"] = edit
        (src / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError) as e:  # config.json alone: refused before a weight is looked for
        hf.import_(src, tmp_path / "out")
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()  # nothing written
    if not case.endswith("tokenizer"):
        with pytest.raises(ValueError, match="nanomega"):
            hf.load_pretrained(src)  # the same line for the Python entry point
    if case == "broken-tokenizer":  # the command: one line on stderr, exit status 2
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "nanomega.tools.hf",
                "import",
                str(src),
                "--out-dir",
                str(tmp_path / "out"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and words in res.stderr, (
            res.stderr
        )


@pytest.mark.parametrize("field,value", [("rms_norm_eps", 0.0), ("rope_theta", -1.0)])
def test_a_config_value_no_flag_would_pass_is_one_line(setup, tmp_path, field, value):
    """Issue 28: GPTConfig.validate did not range-check rope_theta, rope_scaling or norm_eps, so an
    HF config.json with rms_norm_eps 0 imported (a division by zero in every norm). Now the file and
    the field are named."""
    src = tmp_path / "src"
    save_llama(src, **{field: value})
    with pytest.raises(ValueError) as e:
        hf.import_(src, tmp_path / "out")
    # the field itself (tools/hf_check.FIELDS), or the flag it sets (rope_theta: in
    # rope_parameters), the file first
    assert str(e.value).startswith(f"{src / 'config.json'}: ") and field in str(e.value)
    assert "must be a finite number > 0" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_a_transformers_without_the_ranks_hook_is_one_line(monkeypatch):
    """transformers 5.16 and older have no TikTokenConverter.load_tiktoken_bpe (pyproject asks for
    >= 5.17): writing the tokenizer says so in one line instead of failing inside tiktoken on a file
    path it was never given."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    monkeypatch.delattr(TikTokenConverter, "load_tiktoken_bpe", raising=False)
    with pytest.raises(
        ValueError, match=r"^writing the tokenizer needs transformers >= 5.17 \(installed: "
    ):
        tokenizer.to_hf(data.get_tokenizer("shakespeare-4k"))
