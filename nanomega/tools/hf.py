"""Hugging Face in and out: a nanomega checkpoint <-> a transformers GPT-2, Llama or Mixtral folder.

    python -m nanomega.tools.hf export --out-dir out --to mine  # -> config.json, model.safetensors
    python -m nanomega.tools.hf import mine --out-dir ft        # -> a step-0 checkpoint (--resume)
    model = nanomega.tools.hf.load_pretrained("mine")           # -> the dense model.GPT, fp32

nanomega's dense GPT *is* GPT-2, and with arch="llama" it *is* Llama (RoPE in HF's rotate-half
layout: q and k need no permutation), so the exchange is a renaming plus a few details (Mixtral:
tools/hf_moe.py). The checkpoint of any layout is read through reshard.full_weights; what nanomega
cannot compute is refused in one line naming the field, before anything is written. Tokenizers go
through tools/tokenizer.py (to_hf, from_hf). Needs the `hf` extra: pip install transformers
safetensors.

Formulas:
    GPT-2    W_hf = W^T (in, out): transformers' Conv1D weight is the transpose of nn.Linear's
    Llama    kv_proj = [k_proj; v_proj], gate_up = [gate_proj; up_proj], stacked by rows
    vocab    export keeps the first V rows of the embedding (and of an untied head), import appends
             zero rows: logits[..., :V] are equal
Lesson: lessons/13-the-modern-block.md
"""
import argparse
import json
import os
import types
from pathlib import Path

import torch

from nanomega import checkpoint, data, reshard
from nanomega.ops import faults
from nanomega.model import GPT, SHAPE_KEYS, SIZES, GPTConfig
from nanomega.tools import hf_moe, tokenizer
from nanomega.tools.hf_llama import LLAMA3_ROPE, llama_config, llama_name_map

# nanomega name -> transformers GPT2LMHeadModel name, per block ({i}); Conv1D weights are transposed
_BLOCK = {k: k for k in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_attn.weight",
                         "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias", "mlp.c_fc.weight",
                         "mlp.c_proj.weight", "mlp.c_proj.bias")} | {"mlp.fc_bias": "mlp.c_fc.bias"}
_TOP = {"embed.wte.weight": "transformer.wte.weight", "embed.wpe.weight": "transformer.wpe.weight",
        "head.ln_f.weight": "transformer.ln_f.weight", "head.ln_f.bias": "transformer.ln_f.bias"}
_CONV1D = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
_PADDED = ("embed.wte.weight", "head.lm_head.weight")  # (V padded, h) here, (V, h) in transformers


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
    """transformers GPT2LMHeadModel or LlamaForCausalLM (by cfg.arch) from nanomega full weights
    {name: tensor} (fp32; padded rows dropped)."""
    transformers = _require()
    v = cfg.vocab_size
    if cfg.n_experts:  # a Llama with experts: Mixtral
        return hf_moe.to_hf(weights, cfg)
    if cfg.arch == "llama":
        rope = None if cfg.rope_scaling == 1.0 else dict(rope_type="llama3", factor=cfg.rope_scaling, **LLAMA3_ROPE)
        hf_cfg = transformers.LlamaConfig(
            vocab_size=v, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn, num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads, head_dim=cfg.n_embd // cfg.n_head,
            hidden_act="silu", max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta, rope_scaling=rope, tie_word_embeddings=cfg.tie_embeddings,
            attention_bias=False, mlp_bias=False, bos_token_id=v - 1, eos_token_id=v - 1)
        names, model_class = llama_name_map(cfg.n_layer, cfg.tie_embeddings), transformers.LlamaForCausalLM
    else:
        check_gpt2(cfg)
        hf_cfg = transformers.GPT2Config(
            vocab_size=v, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
            n_head=cfg.n_head, activation_function="gelu_new", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
            attn_pdrop=cfg.dropout, layer_norm_epsilon=cfg.norm_eps, bos_token_id=v - 1, eos_token_id=v - 1,
            tie_word_embeddings=True)
        names, model_class = {k: (n,) for k, n in name_map(cfg.n_layer).items()}, transformers.GPT2LMHeadModel
    state = {}
    for ours, theirs in names.items():
        t = weights[ours].float()
        t = t[:v] if ours in _PADDED else t  # (V_padded, h) -> (V, h)
        t = t.t() if ours.endswith(_CONV1D) and cfg.arch == "gpt2" else t
        state.update(zip(theirs, (part.contiguous() for part in t.chunk(len(theirs)))))  # [k; v] -> k, v
    model = model_class(hf_cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [k for k in missing if k != "lm_head.weight" and not k.endswith(".attn.bias")]  # tied / causal buffer
    if left or unexpected or (not cfg.tie_embeddings and "lm_head.weight" in missing):
        raise ValueError(f"{cfg.arch} mapping incomplete: missing {left[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    return model.eval()


def from_hf(model):
    """(GPTConfig, nanomega full weights) from a transformers GPT2LMHeadModel or LlamaForCausalLM;
    refuses what nanomega cannot compute."""
    if model.config.model_type == "mixtral":
        return hf_moe.from_hf(model)
    if model.config.model_type == "llama":
        cfg = llama_config(model.config.to_dict())
        theirs = model.state_dict()
        # a copy, even of one tensor
        weights = {ours: torch.cat([theirs[n].detach().float() for n in names])
                   for ours, names in llama_name_map(cfg.n_layer, cfg.tie_embeddings).items()}
        return cfg, _pad_vocab(weights, cfg)
    c = model.config
    act = getattr(c, "activation_function", "gelu_new")
    bad = [(act not in ("gelu_new", "gelu_pytorch_tanh"), f"activation_function {act!r} (nanomega: tanh GeLU)"),
           (c.n_inner not in (None, 4 * c.n_embd), f"n_inner {c.n_inner} (nanomega: 4 x n_embd)"),
           (getattr(c, "scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx"),
           (not getattr(c, "scale_attn_weights", True), "scale_attn_weights False"),
           (model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr(), "an untied LM head")]
    bad = [why for is_bad, why in bad if is_bad]
    if bad:
        raise ValueError(f"this GPT-2 differs from nanomega's: {'; '.join(bad)}; it cannot be imported exactly")
    cfg = GPTConfig(vocab_size=c.vocab_size, block_size=c.n_positions, n_layer=c.n_layer, n_head=c.n_head,
                    n_embd=c.n_embd, dropout=c.resid_pdrop, norm_eps=c.layer_norm_epsilon)
    theirs = model.state_dict()
    weights = {}
    for ours, name in name_map(cfg.n_layer).items():
        t = theirs[name].detach().float()
        weights[ours] = t.t().contiguous() if ours.endswith(_CONV1D) else t.clone()
    return cfg, _pad_vocab(weights, cfg)


def _pad_vocab(weights, cfg):
    """Zero rows up to the padded vocabulary: never looked up, out of the loss, never sampled."""
    for name in _PADDED:
        if name in weights:
            t = weights[name]
            weights[name] = torch.cat([t, t.new_zeros(cfg.padded_vocab_size - cfg.vocab_size, t.shape[1])])
    return weights


def hf_config(src):
    """config.json of a transformers folder, as a dict; the model types nanomega reads:
    gpt2, llama, mixtral."""
    path = Path(src) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{src} has no config.json: not a transformers model folder")
    c = json.loads(path.read_text())
    if c.get("model_type") not in ("gpt2", "llama", "mixtral"):
        raise ValueError(f"{path}: model_type {c.get('model_type')!r} (nanomega: gpt2, llama or mixtral)")
    if c["model_type"] != "gpt2":  # refused before a weight is read
        (hf_moe.mixtral_config if c["model_type"] == "mixtral" else llama_config)(c)
    return c


def read_hf(src):
    """(GPTConfig, nanomega full weights) of a transformers GPT-2 or Llama folder."""
    transformers = _require()
    kind = hf_config(src)["model_type"]
    model_class = dict(llama=transformers.LlamaForCausalLM, mixtral=transformers.MixtralForCausalLM,
                       gpt2=transformers.GPT2LMHeadModel)[kind]
    try:
        model = model_class.from_pretrained(src, local_files_only=True, dtype=torch.float32)
    except Exception as e:
        # a truncated or missing weights file: the library's own error type, as one line
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{src}: its weights cannot be read ({type(e).__name__}: {first}); copy or export the "
                         f"folder again") from None
    cfg, weights = from_hf(model)
    try:
        # a value no flag would pass (rms_norm_eps 0, rope_theta NaN): named in the file that holds
        # it
        cfg.validate()
    except ValueError as e:
        raise ValueError(f"{Path(src) / 'config.json'}: {e}, as nanomega reads it; fix the file") from None
    return cfg, weights


def load_pretrained(src, attention="eager") -> GPT:
    """The dense nanomega model (model.GPT: fp32, in eval mode, its head tied as the folder says) of
    a transformers GPT-2 or Llama folder; nothing is written, no tokenizer is read."""
    cfg, weights = read_hf(src)
    # eager, sdpa or fused (model.ATTENTION): the model reads it when built
    cfg.attention = attention
    with torch.device("meta"):  # shapes only: the weights are assigned, nothing is drawn first
        model = GPT(cfg, seed=0)
    if cfg.tie_embeddings:
        weights["head.lm_head.weight"] = weights["embed.wte.weight"]
    weights |= {k: b for k, b in model.state_dict().items() if k.endswith("expert_bias")}  # Mixtral has none: 0
    model.load_state_dict(weights, assign=True)
    # assign leaves two Parameters on one tensor: make them one again, as GPT() ties them
    if cfg.tie_embeddings:
        model.head.lm_head.weight = model.embed.wte.weight
    return model.eval()


def export(out_dir, to):
    """Write the latest checkpoint of out_dir as a transformers GPT-2, Llama or Mixtral folder
    `to`; returns it."""
    folder, cfg, tok_name, skipped = checkpoint.saved_model(out_dir)  # the newest that verifies
    for reason in skipped:
        faults.say(f"export: skipped {reason}")
    check_gpt2(cfg)  # before reading any shard (a Llama has no ALiBi: validate refuses it)
    # what a Mixtral cannot hold, before reading the weights: the routing bias is in rank 0's shard
    if cfg.n_experts:
        hf_moe.check(cfg, checkpoint.load_shard(folder, 0).get("moe_bias"))
    model = to_hf(reshard.full_weights(folder), cfg)
    model.save_pretrained(to)  # config.json + model.safetensors (safe serialization is the default)
    tok = tokenizer.to_hf(data.get_tokenizer(tok_name))
    if tok is not None:
        tok.save_pretrained(to)
    return to, tok is not None


def import_tokenizer(src, out_dir):
    """GPT-2 byte-level BPE (vocab.json, or tokenizer.json) in `src` -> out_dir/tokenizer.tiktoken,
    or None."""
    ranks, _ = tokenizer.from_hf(src)
    if ranks is None:
        return None
    path = Path(out_dir).resolve() / "tokenizer.tiktoken"
    tokenizer.save_ranks(ranks, path)
    return str(path)


def import_(src, out_dir):
    """A transformers GPT-2 or Llama folder -> a step-0 nanomega checkpoint in out_dir
    (single-process, dense). What nanomega cannot represent (and, for a Llama, a tokenizer
    --tokenizer cannot read) is refused first."""
    _require()
    if checkpoint.latest(out_dir) is not None:
        raise ValueError(f"--out-dir {out_dir} already holds a checkpoint; choose an empty --out-dir")
    # a Llama whose tokenizer --tokenizer cannot reproduce would fine-tune on ids it was not trained
    # on: refused. (GPT-2 as before: without a readable tokenizer the printed command asks for one.)
    why = tokenizer.from_hf(src)[1] if hf_config(src)["model_type"] != "gpt2" else None
    if why:
        raise ValueError(f"{src}: {why}; nanomega's --tokenizer is byte-level BPE with GPT-2's pattern "
                         f"(data.get_tokenizer); nanomega.tools.hf.load_pretrained(folder) still reads the weights")
    cfg, weights = read_hf(src)
    os.makedirs(out_dir, exist_ok=True)
    tok = import_tokenizer(src, out_dir) or "shakespeare-4k"
    if data.get_tokenizer(tok).n_vocab != cfg.vocab_size:
        # the user must bring the tokenizer (--tokenizer) that has these cfg.vocab_size ids
        tok = None
    pieces = [dict(name=k, shape=tuple(t.shape), start=0, end=t.numel(), master=t.reshape(-1), state={})
              # reshard.load's by-name format; empty state: a fresh AdamW
              for k, t in weights.items()]
    state = dict(universal=dict(tp_rank=0, pieces=pieces), sampler=None, scaler=None, step=0, rng=None)
    layout = dict(imported_from=os.path.abspath(src), **({"tokenizer": tok} if tok else {}))
    # a world of one: no process group
    one_rank = types.SimpleNamespace(rank=0, world=1, barrier=lambda: None)
    checkpoint.save(out_dir, 0, cfg, state, one_rank, layout)
    return cfg, tok


def train_flags(cfg: GPTConfig):
    """train.py's model flags that rebuild cfg (a resume compares every SHAPE_KEYS field); the
    vocabulary comes with --tokenizer."""
    out, default = [], GPTConfig()
    for k in SHAPE_KEYS:
        v, flag = getattr(cfg, k), "--" + k.replace("_", "-")
        if k == "vocab_size" or (k not in SIZES and v == getattr(default, k)):
            continue
        out.append("--untie-embeddings" if k == "tie_embeddings" else flag if v is True else f"{flag} {v}")
    return " ".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="checkpoint (any layout) -> transformers GPT-2, Llama or Mixtral folder")
    e.add_argument("--out-dir", default="out")
    e.add_argument("--to", required=True, help="the folder to write (config.json, model.safetensors, tokenizer)")
    i = sub.add_parser("import", help="transformers GPT-2, Llama or Mixtral folder -> step-0 checkpoint for "
                       "train.py --resume")
    i.add_argument("src")
    i.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    if args.cmd == "export":
        to, with_tok = export(args.out_dir, args.to)
        print(f"wrote {to}: config.json, model.safetensors" + (", tokenizer.json" if with_tok else
              " (no HF tokenizer equivalent for this tokenizer)"))
        return
    cfg, tok = import_(args.src, args.out_dir)
    print(f"wrote a step-0 checkpoint to {args.out_dir}/ckpt; fine-tune with:\n  python nanomega/train.py --resume "
          f"--out-dir {args.out_dir} {train_flags(cfg)} --tokenizer {tok or 'FILE_WITH_%d_IDS' % cfg.vocab_size}")


def cli():
    """The console script (pyproject [project.scripts])."""
    faults.entrypoint(main)  # bad input: one line, exit 2


if __name__ == "__main__":
    cli()
