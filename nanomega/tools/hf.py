"""Hugging Face GPT-2 in and out: a nanomega checkpoint <-> a transformers `GPT2LMHeadModel` folder.

    python -m nanomega.tools.hf export --out-dir out --to gpt2-mine     # any layout -> config.json + model.safetensors
    python -m nanomega.tools.hf import gpt2-mine --out-dir ft           # -> a step-0 checkpoint: train.py --resume

Idea: nanomega's dense GPT *is* GPT-2 (pre-LayerNorm blocks, learned positions, tanh GeLU, tied head,
LayerNorm eps 1e-5, qkv laid out (3, n_head, head_dim)), so the exchange is a renaming plus two details:
  - transformers' GPT-2 uses Conv1D, whose weight is the transpose of nn.Linear's: W_hf = W^T (in, out).
  - nanomega pads the vocabulary to a multiple of 128 x tp (Megatron); GPT-2 does not (50,257). Export keeps
    the first V rows of the embedding, import appends zero rows; the padded rows are out of the loss
    (model.cross_entropy) and never sampled, so both directions are exact: logits[..., :V] are equal.
Models that are not GPT-2 (ALiBi, an embedding LayerNorm: BLOOM's) are refused with one line.
The checkpoint of any tp x pp x dp x ZeRO layout is read through reshard.full_weights (full tensors).
Tokenizer: a byte-level BPE with GPT-2's split pattern (shakespeare-4k, a .tiktoken file) becomes an HF
tokenizer.json (transformers' TikTokenConverter); import turns GPT-2's vocab.json/tokenizer.json back into
a .tiktoken file that `--tokenizer` reads.
Needs the `hf` extra: pip install transformers safetensors.
"""
import argparse
import json
import os
from pathlib import Path

import torch

from nanomega import checkpoint, data, reshard
from nanomega.ops import faults
from nanomega.data import ENDOFTEXT, GPT2_PATTERN
from nanomega.model import SIZES, GPTConfig
from nanomega.tools.tokenizer import save_ranks

# nanomega name -> transformers GPT2LMHeadModel name, per block ({i}); Conv1D weights are transposed
_BLOCK = {"ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias", "ln_2.weight": "ln_2.weight",
          "ln_2.bias": "ln_2.bias", "attn.c_attn.weight": "attn.c_attn.weight", "attn.c_attn.bias": "attn.c_attn.bias",
          "attn.c_proj.weight": "attn.c_proj.weight", "attn.c_proj.bias": "attn.c_proj.bias",
          "mlp.c_fc.weight": "mlp.c_fc.weight", "mlp.fc_bias": "mlp.c_fc.bias",
          "mlp.c_proj.weight": "mlp.c_proj.weight", "mlp.c_proj.bias": "mlp.c_proj.bias"}
_TOP = {"embed.wte.weight": "transformer.wte.weight", "embed.wpe.weight": "transformer.wpe.weight",
        "head.ln_f.weight": "transformer.ln_f.weight", "head.ln_f.bias": "transformer.ln_f.bias"}
_CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


def _require():
    try:
        import safetensors  # noqa: F401  (save_pretrained writes model.safetensors with it)
        import transformers
    except ImportError:
        raise ValueError("nanomega.tools.hf needs transformers and safetensors: pip install 'nanomega[hf]'") from None
    return transformers


def name_map(n_layer):
    """{nanomega parameter name: transformers name} for a GPT of n_layer blocks."""
    names = dict(_TOP)
    for i in range(n_layer):
        names.update({f"blocks.{i}.{a}": f"transformer.h.{i}.{b}" for a, b in _BLOCK.items()})
    return names


def check_gpt2(cfg: GPTConfig):
    if cfg.alibi or cfg.embed_layernorm:
        what = "ALiBi attention" if cfg.alibi else "an embedding LayerNorm"
        raise ValueError(f"this model has {what} (BLOOM-style), which GPT-2 does not: it cannot be exported "
                         f"as a GPT2LMHeadModel; train without --alibi/--embed-layernorm to export")


def to_hf(weights, cfg: GPTConfig):
    """transformers GPT2LMHeadModel from nanomega full weights {name: tensor} (fp32; padded rows dropped)."""
    transformers = _require()
    check_gpt2(cfg)
    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
        n_head=cfg.n_head, activation_function="gelu_new", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout, layer_norm_epsilon=1e-5, bos_token_id=cfg.vocab_size - 1,
        eos_token_id=cfg.vocab_size - 1, tie_word_embeddings=True)
    state = {}
    for ours, theirs in name_map(cfg.n_layer).items():
        t = weights[ours].float()
        if ours == "embed.wte.weight":
            t = t[:cfg.vocab_size]  # (V_padded, h) -> (V, h)
        state[theirs] = t.t().contiguous() if ours.endswith(_CONV1D) else t
    model = transformers.GPT2LMHeadModel(hf_cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [k for k in missing if k != "lm_head.weight" and not k.endswith(".attn.bias")]  # tied / causal buffer
    if left or unexpected:
        raise ValueError(f"GPT-2 mapping incomplete: missing {left[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    return model.eval()


def from_hf(model):
    """(GPTConfig, nanomega full weights) from a transformers GPT2LMHeadModel; refuses what is not GPT-2."""
    c = model.config
    act = getattr(c, "activation_function", "gelu_new")
    bad = [(act not in ("gelu_new", "gelu_pytorch_tanh"), f"activation_function {act!r} (nanomega: tanh GeLU)"),
           (abs(c.layer_norm_epsilon - 1e-5) > 1e-12, f"layer_norm_epsilon {c.layer_norm_epsilon} (nanomega: 1e-5)"),
           (c.n_inner not in (None, 4 * c.n_embd), f"n_inner {c.n_inner} (nanomega: 4 x n_embd)"),
           (getattr(c, "scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx"),
           (not getattr(c, "scale_attn_weights", True), "scale_attn_weights False"),
           (model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr(), "an untied LM head")]
    bad = [why for is_bad, why in bad if is_bad]
    if bad:
        raise ValueError(f"this GPT-2 differs from nanomega's: {'; '.join(bad)}; it cannot be imported exactly")
    cfg = GPTConfig(vocab_size=c.vocab_size, block_size=c.n_positions, n_layer=c.n_layer, n_head=c.n_head,
                    n_embd=c.n_embd, dropout=c.resid_pdrop)
    theirs = model.state_dict()
    weights = {}
    for ours, name in name_map(cfg.n_layer).items():
        t = theirs[name].detach().float()
        weights[ours] = t.t().contiguous() if ours.endswith(_CONV1D) else t.clone()
    pad = cfg.padded_vocab_size - cfg.vocab_size  # zero rows: never looked up, out of the loss, never sampled
    wte = weights["embed.wte.weight"]
    weights["embed.wte.weight"] = torch.cat([wte, wte.new_zeros(pad, c.n_embd)])
    return cfg, weights


def _hf_tokenizer(enc):
    """An HF fast tokenizer equal to a GPT-2-pattern tiktoken Encoding, or None if it has no such equivalent."""
    if enc._pat_str != GPT2_PATTERN or set(enc._special_tokens) != {ENDOFTEXT}:
        return None
    transformers = _require()
    from transformers.convert_slow_tokenizer import TikTokenConverter
    conv = TikTokenConverter(pattern=GPT2_PATTERN, extra_special_tokens=[ENDOFTEXT])
    conv.load_tiktoken_bpe = lambda _: enc._mergeable_ranks  # the ranks we already hold, not a file or URL
    return transformers.PreTrainedTokenizerFast(tokenizer_object=conv.converted(), bos_token=ENDOFTEXT,
                                                eos_token=ENDOFTEXT, unk_token=ENDOFTEXT,
                                                model_max_length=None)


def export(out_dir, to):
    """Write the latest checkpoint of out_dir as a transformers GPT-2 folder `to`; returns its path."""
    folder, cfg, tok_name = checkpoint.saved_model(out_dir)
    check_gpt2(cfg)  # before reading any shard
    model = to_hf(reshard.full_weights(folder), cfg)
    model.save_pretrained(to)  # config.json + model.safetensors (safe serialization is the default)
    tok = _hf_tokenizer(data.get_tokenizer(tok_name))
    if tok is not None:
        tok.save_pretrained(to)
    return to, tok is not None


def _byte_decoder():
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    return {v: k for k, v in bytes_to_unicode().items()}


def import_tokenizer(src, out_dir):
    """GPT-2 byte-level BPE (vocab.json, or tokenizer.json) in `src` -> out_dir/tokenizer.tiktoken, or None."""
    src = Path(src)
    if (src / "tokenizer.json").is_file():  # the BPE vocabulary, and the special tokens kept apart from it
        spec = json.loads((src / "tokenizer.json").read_text())
        vocab = dict(spec["model"].get("vocab", {}), **{t["content"]: t["id"] for t in spec.get("added_tokens", [])})
    elif (src / "vocab.json").is_file():  # GPT-2's original files: vocab.json (+ merges.txt)
        vocab = json.loads((src / "vocab.json").read_text())
    else:
        return None
    dec = _byte_decoder()
    ranks = {bytes(dec[ch] for ch in tok): i for tok, i in vocab.items() if tok != ENDOFTEXT}
    if sorted(ranks.values()) != list(range(len(ranks))) or vocab.get(ENDOFTEXT) != len(ranks):
        return None  # not GPT-2's layout (ranks 0..n-1, then <|endoftext|>): no .tiktoken equivalent
    path = Path(out_dir).resolve() / "tokenizer.tiktoken"
    save_ranks(ranks, path)
    return str(path)


def import_(src, out_dir):
    """A transformers GPT-2 folder -> a step-0 nanomega checkpoint in out_dir (single-process, dense)."""
    transformers = _require()
    if checkpoint.latest(out_dir) is not None:
        raise ValueError(f"--out-dir {out_dir} already holds a checkpoint; choose an empty --out-dir")
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise FileNotFoundError(f"{src} has no config.json: not a transformers model folder")
    model = transformers.GPT2LMHeadModel.from_pretrained(src, local_files_only=True, dtype=torch.float32)
    cfg, weights = from_hf(model)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = import_tokenizer(src, out_dir) or "shakespeare-4k"
    if data.get_tokenizer(tokenizer).n_vocab != cfg.vocab_size:
        tokenizer = None  # the user must bring the tokenizer (--tokenizer) that has these cfg.vocab_size ids
    pieces = [dict(name=k, shape=tuple(t.shape), start=0, end=t.numel(), master=t.reshape(-1), state={})
              for k, t in weights.items()]  # reshard.load's by-name format; empty state: a fresh AdamW
    state = dict(universal=dict(tp_rank=0, pieces=pieces), sampler=None, scaler=None, step=0, rng=None)
    layout = dict(imported_from=os.path.abspath(src), **({"tokenizer": tokenizer} if tokenizer else {}))
    checkpoint.save(out_dir, 0, cfg, state, _OneRank(), layout)
    return cfg, tokenizer


class _OneRank:
    """checkpoint.save's view of a world of one (no process group needed to write a step-0 checkpoint)."""
    rank, world = 0, 1

    def barrier(self):
        pass


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="checkpoint (any layout) -> transformers GPT-2 folder")
    e.add_argument("--out-dir", default="out")
    e.add_argument("--to", required=True, help="the folder to write (config.json, model.safetensors, tokenizer)")
    i = sub.add_parser("import", help="transformers GPT-2 folder -> step-0 checkpoint for train.py --resume")
    i.add_argument("src")
    i.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    if args.cmd == "export":
        to, with_tok = export(args.out_dir, args.to)
        print(f"wrote {to}: config.json, model.safetensors" + (", tokenizer.json" if with_tok else
              " (no HF tokenizer equivalent for this tokenizer)"))
        return
    cfg, tok = import_(args.src, args.out_dir)
    sizes = [k for k in SIZES if k != "vocab_size"]  # the vocabulary comes with --tokenizer; GPT-2 has no switches
    flags = " ".join(f"--{k.replace('_', '-')} {getattr(cfg, k)}" for k in sizes)
    print(f"wrote a step-0 checkpoint to {args.out_dir}/ckpt; fine-tune with:\n  python nanomega/train.py --resume "
          f"--out-dir {args.out_dir} {flags} --tokenizer {tok or 'FILE_WITH_%d_IDS' % cfg.vocab_size}")


def cli():
    """The console script (pyproject [project.scripts])."""
    faults.entrypoint(main)  # bad input: one line, exit 2


if __name__ == "__main__":
    cli()
