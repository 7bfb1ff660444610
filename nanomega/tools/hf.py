"""Hugging Face in and out: a nanomega checkpoint <-> a transformers GPT-2, Llama, Qwen2, Qwen3,
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE or DeepSeek-V3 folder (its MTP modules and routing biases
included: tools/hf_deepseek.py).

    python -m nanomega.tools.hf export --out-dir out --to mine  # -> config.json, model.safetensors
    python -m nanomega.tools.hf import mine --out-dir ft        # -> a step-0 checkpoint (--resume)
    model = nanomega.tools.hf.load_pretrained("mine")           # -> the dense model.GPT, fp32

nanomega's dense GPT *is* GPT-2, and with arch="llama" it *is* Llama (RoPE in HF's rotate-half
layout: q and k need no permutation), so the exchange is a renaming plus a few details (Qwen2's
q, k, v biases and Qwen3's QK-norm: tools/hf_llama.py; the MoE models: tools/hf_moe.py). The checkpoint of
any layout is read through reshard.full_weights. A folder is trusted in nothing (tools/hf_check.py:
config.json field by field, every tensor's name and shape, transformers' load report): what is
damaged, or what nanomega cannot compute, is refused in one line naming the file and the field or
tensor, before anything is written. Tokenizers go through tools/tokenizer.py (to_hf, from_hf).
Needs the `hf` extra: pip install transformers safetensors.

Formulas:
    GPT-2    W_hf = W^T (in, out): transformers' Conv1D weight is the transpose of nn.Linear's
    Llama    kv_proj = [k_proj; v_proj], gate_up = [gate_proj; up_proj], stacked by rows
    Qwen2    kv_proj.bias = [k_proj.bias; v_proj.bias]
    vocab    export keeps the first V rows of the embedding (and of an untied head), import appends
             zero rows: logits[..., :V] are equal
Lesson: lessons/02-the-modern-block.md
"""

import argparse
import dataclasses
import functools
import json
import os
import shutil
import types
from pathlib import Path

import torch

from nanomega import checkpoint, data
from nanomega.job import faults, lifecycle
from nanomega.gpt_config import SHAPE_KEYS, SIZES, GPTConfig
from nanomega.model import GPT
from nanomega.tools import hf_check, hf_deepseek, hf_moe, hf_shards, tokenizer
from nanomega.tools.hf_llama import DENSE, llama_config
from nanomega.tools.hf_weights import check_gpt2, from_hf, gpt2_config, require_transformers

# a Hugging Face tokenizer: the file the tokenizers library reads, and its settings (BOS, EOS)
HF_TOKENIZER = ("tokenizer.json", "tokenizer_config.json")
# model_type -> its config.json read as a GPTConfig (what nanomega cannot compute: one line)
CONFIGS = dict(
    gpt2=gpt2_config,
    **{kind: functools.partial(llama_config, kind=kind) for kind in DENSE},
    **hf_moe.CONFIGS,  # mixtral, qwen2_moe, qwen3_moe, olmoe
    deepseek_v3=hf_deepseek.deepseek_v3_config,  # and the folder's MTP modules (hf_config)
)


def hf_config(src):
    """(config.json of a transformers folder as a dict, the GPTConfig nanomega reads from it): the
    model types nanomega reads (CONFIGS: gpt2, llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe,
    olmoe, deepseek_v3), every field checked (tools/hf_check.py) before a weight is read."""
    path = Path(src) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{src} has no config.json: not a transformers model folder")
    c = hf_check.read_json(path)
    kind = c.get("model_type")
    if kind not in CONFIGS:
        raise ValueError(f"{path}: model_type {kind!r} (nanomega: {', '.join(CONFIGS)})")
    hf_check.check_fields(path, c, kind)
    try:
        cfg = CONFIGS[kind](c)
        if kind == "deepseek_v3":  # the MTP modules the folder holds (config.json's may be 1)
            cfg = dataclasses.replace(cfg, mtp_num_layers=mtp(src, c))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    return c, hf_check.check_shape(path, cfg, kind)


def mtp(src, c):
    """The MTP modules of DeepSeek-V3 folder src (config.json c) nanomega reads; any it skips (MoE
    ones): one line said."""
    try:
        found = hf_check.tensor_shapes(src)
    except ValueError:  # no readable weights: hf_check.check_tensors says so, naming the file
        return 0
    depths, why = hf_deepseek.mtp_depths(c, found)
    if why:
        faults.say(f"{src}: {why}")
    return depths


def mtp_tensors(src, cfg):
    """{name: tensor} of the MTP modules nanomega reads from folder src (transformers' class holds
    none): read from the weights files by name."""
    from safetensors import safe_open

    out = {}
    for name, (_, file) in hf_check.tensor_shapes(src).items():
        if 0 <= hf_deepseek.mtp_layer(name, cfg.n_layer) < cfg.mtp_num_layers:
            with safe_open(Path(src) / file, "pt") as f:
                out[name] = f.get_tensor(name)
    return out


def read_hf(src):
    """(GPTConfig, nanomega full weights) of a transformers GPT-2, Llama, Qwen or Mixtral folder: its
    config and its tensors' names and shapes checked first, then transformers' load report."""
    transformers = require_transformers()
    c, cfg = hf_config(src)
    hf_check.check_tensors(src, cfg, c["model_type"])
    model_class = dict(
        llama=transformers.LlamaForCausalLM,
        qwen2=transformers.Qwen2ForCausalLM,
        qwen3=transformers.Qwen3ForCausalLM,
        mixtral=transformers.MixtralForCausalLM,
        qwen2_moe=transformers.Qwen2MoeForCausalLM,
        qwen3_moe=transformers.Qwen3MoeForCausalLM,
        olmoe=transformers.OlmoeForCausalLM,
        deepseek_v3=transformers.DeepseekV3ForCausalLM,
        gpt2=transformers.GPT2LMHeadModel,
    )[c["model_type"]]

    try:
        with hf_check.quiet(transformers):
            model, info = model_class.from_pretrained(
                src, local_files_only=True, dtype=torch.float32, output_loading_info=True
            )
    except Exception as e:
        # a file the headers did not give away: the library's own error type, as one line
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"{src}: its weights cannot be read ({type(e).__name__}: {first}); copy or export the "
            f"folder again"
        ) from None
    if c["model_type"] == "deepseek_v3":  # the MTP modules: read apart (mtp_tensors)
        layers = cfg.n_layer
        info["unexpected_keys"] = [
            k for k in info.get("unexpected_keys") or () if hf_deepseek.mtp_layer(k, layers) < 0
        ]
        hf_check.check_load_report(src, info)
        cfg, weights = hf_deepseek.from_hf(model, mtp_tensors(src, cfg))
    else:
        hf_check.check_load_report(src, info)
        cfg, weights = from_hf(model)
    # as transformers read it: checked as training checks it, named in the file that holds it
    return hf_check.check_shape(Path(src) / "config.json", cfg, c["model_type"]), weights


def load_pretrained(src, attention="eager") -> GPT:
    """The dense nanomega model (model.GPT: fp32, in eval mode, its head tied as the folder says) of
    a transformers GPT-2, Llama, Qwen or Mixtral folder; nothing is written, no tokenizer is read."""
    cfg, weights = read_hf(src)
    # eager, sdpa or fused (gpt_config.ATTENTION): the model reads it when built
    cfg.attention = attention
    with torch.device("meta"):  # shapes only: the weights are assigned, nothing is drawn first
        model = GPT(cfg, seed=0)
    if cfg.tie_embeddings:
        weights["head.lm_head.weight"] = weights["embed.wte.weight"]
    # Mixtral has none: 0 (DeepSeek-V3's: the folder's)
    weights = {k: b for k, b in model.state_dict().items() if k.endswith("expert_bias")} | weights
    model.load_state_dict(weights, assign=True)
    # assign leaves two Parameters on one tensor: make them one again, as GPT() ties them
    if cfg.tie_embeddings:
        model.head.lm_head.weight = model.embed.wte.weight
    return model.eval()


def export(out_dir, to, max_shard_size=hf_shards.MAX_SHARD_SIZE):
    """Write the latest checkpoint of out_dir as a transformers GPT-2, Llama, Qwen or Mixtral folder
    `to`, streamed one safetensors shard (of at most max_shard_size bytes) at a time
    (tools/hf_shards.py); returns (to, whether a tokenizer was written)."""
    folder, cfg, tok_name, skipped = checkpoint.saved_model(out_dir)  # the newest that verifies
    for reason in skipped:
        faults.say(f"export: skipped {reason}")
    check_gpt2(cfg)  # before reading any shard (a Llama has no ALiBi: validate refuses it)
    # the routing biases (every layer's, in every shard: moe.bias_table) travel beside the weights
    bias = checkpoint.load_shard(folder, 0).get("moe_bias") if cfg.n_experts else None
    extra = {f"blocks.{i}.mlp.expert_bias": bias[i] for i in range(cfg.n_layer) if cfg.is_moe(i)}
    # what a Mixtral cannot hold, before reading the weights (a DeepSeek-V3's: hf_deepseek.check)
    if cfg.n_experts and not cfg.kv_lora_rank:
        hf_moe.check(cfg, bias)
    # config.json + safetensors (+ their index)
    hf_shards.write(folder, cfg, to, max_shard_size, extra if bias is not None else None)
    enc = data.get_tokenizer(tok_name)
    if isinstance(enc, data.HFTokenizer):  # an imported tokenizer.json goes back as it came
        copy_tokenizer(Path(tok_name).parent, to)
        return to, True
    tok = tokenizer.to_hf(enc)
    if tok is not None:
        tok.save_pretrained(to)
    return to, tok is not None


def copy_tokenizer(src, to):
    """tokenizer.json (and tokenizer_config.json: BOS, EOS, the chat template) from folder src to
    folder to; returns the copied tokenizer.json's path."""
    os.makedirs(to, exist_ok=True)
    for name in HF_TOKENIZER:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(to) / name)
    return str(Path(to).resolve() / HF_TOKENIZER[0])


def import_tokenizer(src, out_dir):
    """The tokenizer of folder `src` for --tokenizer, or None: GPT-2's byte-level BPE (vocab.json,
    or tokenizer.json in GPT-2's layout) -> out_dir/tokenizer.tiktoken; any other tokenizer.json
    (Llama 3's, Qwen's, ...) copied to out_dir, read by the tokenizers library (data.HFTokenizer)."""
    ranks, _ = tokenizer.from_hf(src)
    if ranks is None:
        return copy_tokenizer(src, out_dir) if (Path(src) / HF_TOKENIZER[0]).is_file() else None
    path = Path(out_dir).resolve() / "tokenizer.tiktoken"
    tokenizer.save_ranks(ranks, path)
    return str(path)


def import_(src, out_dir):
    """A transformers GPT-2, Llama, Qwen or Mixtral folder -> a step-0 nanomega checkpoint in out_dir
    (single-process, dense).
    What nanomega cannot represent (and, for a Llama, a tokenizer --tokenizer cannot read) is
    refused first."""
    require_transformers()
    if checkpoint.latest(out_dir) is not None:
        raise ValueError(
            f"--out-dir {out_dir} already holds a checkpoint; choose an empty --out-dir"
        )

    # a Llama whose tokenizer --tokenizer cannot reproduce would fine-tune on ids it was not trained
    # on: refused. (GPT-2 as before: without a readable tokenizer the printed command asks for one.)
    # Every tokenizer file is read here, before anything is written: a damaged one is named. A
    # tokenizer.json not in GPT-2's layout is read by the tokenizers library (data.HFTokenizer).
    kind = hf_config(src)[0]["model_type"]
    why = tokenizer.from_hf(src)[1]
    if why and (Path(src) / HF_TOKENIZER[0]).is_file():
        data.HFTokenizer(Path(src) / HF_TOKENIZER[0])  # read by the tokenizers library, or one line
        why = None
    if why and kind != "gpt2":
        raise ValueError(
            f"{src}: {why}; nanomega's --tokenizer is byte-level BPE with GPT-2's pattern "
            f"(data.get_tokenizer); nanomega.tools.hf.load_pretrained(folder) still reads the weights"
        )

    cfg, weights = read_hf(src)
    os.makedirs(out_dir, exist_ok=True)
    tok = import_tokenizer(src, out_dir) or "shakespeare-4k"
    if data.get_tokenizer(tok).n_vocab != cfg.vocab_size:
        # the user must bring the tokenizer (--tokenizer) that has these cfg.vocab_size ids
        tok = None

    # the tokenizer and its fingerprint: the first fine-tune's resume compares it (RESUME_CHECKS)
    fingerprint = (
        dict(tokenizer_sha256=data.tokenizer_sha256(data.get_tokenizer(tok))) if tok else {}
    )
    layout = dict(
        imported_from=os.path.abspath(src), **({"tokenizer": tok} if tok else {}), **fingerprint
    )
    layout |= routing(cfg)  # a fine-tune under another router is refused (faults.RESUME_CHECKS)
    save_dense(out_dir, cfg, weights, layout)
    return cfg, tok


def save_dense(out_dir, cfg, weights, layout):
    """Full weights {name: tensor} -> a step-0 checkpoint of one process in out_dir, with a fresh
    optimizer (train.py --resume fine-tunes it under any layout)."""
    pieces = [
        dict(name=k, shape=tuple(t.shape), start=0, end=t.numel(), master=t.reshape(-1), state={})
        # reshard.load's by-name format; empty state: a fresh AdamW
        for k, t in weights.items()
        if not k.endswith("expert_bias")
    ]
    state = dict(
        universal=dict(tp_rank=0, pieces=pieces), sampler=None, scaler=None, step=0, rng=None
    )
    if cfg.n_experts:  # the routing biases: moe.bias_table's (n_layer, E) table, in every shard
        bias = torch.zeros(cfg.n_layer, cfg.n_experts)
        for i in filter(cfg.is_moe, range(cfg.n_layer)):
            bias[i] = weights.get(f"blocks.{i}.mlp.expert_bias", bias[i])
        state["moe_bias"] = bias
    # a world of one: no process group
    one_rank = types.SimpleNamespace(rank=0, world=1, barrier=lambda: None)
    checkpoint.save(out_dir, 0, cfg, state, one_rank, layout)


def routing(cfg: GPTConfig):
    """{option: value} of an MoE model's routing arithmetic the GPTConfig holds (faults.ROUTING)."""
    return {k: getattr(cfg, k) for k in faults.ROUTING if cfg.n_experts and hasattr(cfg, k)}


def train_flags(cfg: GPTConfig):
    """train.py's model flags that rebuild cfg (a resume compares every SHAPE_KEYS field, and the
    routing options an import records); the vocabulary comes with --tokenizer."""
    out, default = [], GPTConfig()
    for k in SHAPE_KEYS + tuple(routing(cfg)):
        v, flag = getattr(cfg, k), "--" + k.replace("_", "-")
        if k == "vocab_size" or (k not in SIZES and v == getattr(default, k)):
            continue
        out.append(
            "--untie-embeddings" if k == "tie_embeddings" else flag if v is True else f"{flag} {v}"
        )
    return " ".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser(
        "export",
        help="checkpoint (any layout) -> transformers GPT-2, Llama, Qwen or Mixtral folder",
    )
    e.add_argument("--out-dir", default="out")
    e.add_argument(
        "--to",
        required=True,
        help="the folder to write (config.json, model.safetensors, tokenizer)",
    )
    e.add_argument(
        "--max-shard-size",
        type=float,
        default=hf_shards.MAX_SHARD_SIZE / 1024**3,
        help="GiB per safetensors shard: the export holds about one in memory (default 5)",
    )

    i = sub.add_parser(
        "import",
        help="transformers GPT-2, Llama, Qwen or Mixtral folder -> step-0 checkpoint for "
        "train.py --resume",
    )
    i.add_argument("src")
    i.add_argument("--out-dir", required=True)

    args = p.parse_args(argv)
    if args.cmd == "export":
        if not args.max_shard_size > 0:
            raise ValueError(f"--max-shard-size must be > 0 GiB, got {args.max_shard_size}")
        to, with_tok = export(args.out_dir, args.to, int(args.max_shard_size * 1024**3))
        index = Path(to) / hf_shards.INDEX
        shards = (
            len(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else 0
        )
        print(
            f"wrote {to}: config.json, "
            + (f"{shards} safetensors shards + {index.name}" if shards else "model.safetensors")
            + (
                ", tokenizer.json"
                if with_tok
                else " (no HF tokenizer equivalent for this tokenizer)"
            )
        )
        return

    cfg, tok = import_(args.src, args.out_dir)
    print(
        f"wrote a step-0 checkpoint to {args.out_dir}/ckpt; fine-tune with:\n  python nanomega/train.py --resume "
        f"--out-dir {args.out_dir} {train_flags(cfg)} --tokenizer {tok or 'FILE_WITH_%d_IDS' % cfg.vocab_size}"
    )


def cli():
    """The console script (pyproject [project.scripts])."""
    lifecycle.entrypoint(main)  # bad input: one line, exit 2


if __name__ == "__main__":
    cli()
