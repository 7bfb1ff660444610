"""torch.distributed.checkpoint (DCP) in and out, with torchtitan's Llama state-dict names.

    python -m nanomega.tools.dcp export --out-dir out --to titan-ckpt     # a dense Llama's weights
    python -m nanomega.tools.dcp import titan-ckpt --out-dir ft --n-head 32 --rope-theta 500000

Megatron-Core and torchtitan save DCP: a folder of .distcp files and a .metadata index, each tensor
under its fully qualified name. torchtitan's Llama 3 names its parameters tok_embeddings,
layers.i.attention.{wq,wk,wv,wo}, layers.i.feed_forward.{w1,w2,w3} (gate, down, up),
layers.i.{attention,ffn}_norm, norm, output; and rotates q and k in Meta's interleaved layout,
where nanomega (and Hugging Face) rotate halves: the rows of wq and wk of each head are permuted
(pure reshapes, so a round trip is bitwise). Export writes the model's weights only (torchtitan's
model-only checkpoint: its `initial_load_path`); import writes a step-0 nanomega checkpoint that
train.py --resume fine-tunes under any layout. DCP holds no model arguments: the heads, the RoPE
base and the vocabulary come from the command line and the tensors' shapes.
Formulas (per head of hd rows, pairs p < hd/2):
    Meta row 2p, 2p+1  <->  rotate-half row p, p + hd/2     (w.view(heads, hd/2, 2, h) <-> (heads, 2, hd/2, h))
Lesson: lessons/19-checkpoints-and-failures.md
"""

import argparse
import os

import torch
import torch.distributed.checkpoint as dcp

from nanomega import checkpoint, reshard
from nanomega.gpt_config import GPTConfig
from nanomega.job import lifecycle
from nanomega.tools import hf
from nanomega.tools.hf_llama import llama_name_map

# transformers' Llama names -> torchtitan's (per block: model.layers.{i}. -> layers.{i}.)
TITAN = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def titan_name(hf_name):
    """torchtitan's name of a transformers Llama tensor."""
    if hf_name in TITAN:
        return TITAN[hf_name]
    _, _, i, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"layers.{i}.{TITAN[rest]}"


def interleave(w, heads):
    """Rotate-half rows of q or k -> Meta's interleaved ones, per head ((heads hd, h))."""
    return w.view(heads, 2, w.shape[0] // heads // 2, -1).transpose(1, 2).reshape(w.shape)


def deinterleave(w, heads):
    """Meta's interleaved rows of q or k -> rotate-half ones (the inverse of interleave)."""
    return w.view(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def check(cfg: GPTConfig):
    extras = (cfg.n_experts, cfg.qkv_bias, cfg.qk_norm, cfg.qk_norm_whole, cfg.kv_lora_rank)
    if cfg.arch != "llama" or any(extras) or cfg.mtp_num_layers:
        raise ValueError(
            "nanomega.tools.dcp writes torchtitan's dense Llama 3: --arch llama without --n-experts, "
            "--qkv-bias, --qk-norm, --qk-norm-whole, --kv-lora-rank or --mtp-num-layers"
        )


def to_titan(weights, cfg: GPTConfig):
    """{torchtitan name: tensor} of nanomega full weights {name: tensor} of a dense Llama."""
    check(cfg)
    out = {}
    for ours, theirs in llama_name_map(cfg.n_layer, cfg.tie_embeddings).items():
        t = weights[ours].float()
        t = t[: cfg.vocab_size] if ours in ("embed.wte.weight", "head.lm_head.weight") else t
        for name, part in zip(theirs, t.chunk(len(theirs))):
            heads = cfg.n_head if "q_proj" in name else cfg.kv_heads if "k_proj" in name else 0
            out[titan_name(name)] = (interleave(part, heads) if heads else part).contiguous()
    return out


def export(out_dir, to):
    """The newest verified checkpoint of out_dir -> a DCP folder `to` of torchtitan's names."""
    folder, cfg, _, _ = checkpoint.saved_model(out_dir)
    check(cfg)
    dcp.save(to_titan(reshard.full_weights(folder), cfg), checkpoint_id=to)
    return cfg


def import_(src, out_dir, n_head, rope_theta=500000.0, n_kv_head=0, norm_eps=1e-5, block_size=8192):
    """A DCP folder of torchtitan's Llama names -> a step-0 nanomega checkpoint in out_dir; the
    shape from the tensors' shapes and the flags. Returns the GPTConfig."""
    meta = dcp.FileSystemReader(src).read_metadata().state_dict_metadata
    shape = {k: tuple(m.size) for k, m in meta.items() if hasattr(m, "size")}
    if "tok_embeddings.weight" not in shape:
        raise ValueError(f"{src}: no tok_embeddings.weight: not torchtitan's Llama (model-only)")
    (v, h), (f, _) = shape["tok_embeddings.weight"], shape["layers.0.feed_forward.w1.weight"]
    kv = n_kv_head or shape["layers.0.attention.wk.weight"][0] // (h // n_head)
    layers = len({k.split(".")[1] for k in shape if k.startswith("layers.")})
    cfg = GPTConfig(
        arch="llama",
        vocab_size=v,
        block_size=block_size,
        n_layer=layers,
        n_head=n_head,
        n_kv_head=kv,
        n_embd=h,
        ffn_hidden=f,
        rope_theta=rope_theta,
        tie_embeddings="output.weight" not in shape,
        norm_eps=norm_eps,
    )
    cfg.validate()
    state = {k: torch.empty(s) for k, s in shape.items()}
    dcp.load(state, checkpoint_id=src)  # (no process group: this process reads every file)

    # torchtitan's names -> nanomega's, q and k back to rotate-half, the vocabulary padded
    weights = {}
    for ours, theirs in llama_name_map(cfg.n_layer, cfg.tie_embeddings).items():
        parts = []
        for name in theirs:
            t, heads = state[titan_name(name)], n_head if "q_proj" in name else kv
            parts.append(deinterleave(t, heads) if "q_proj" in name or "k_proj" in name else t)
        weights[ours] = torch.cat(parts)
    for name in ("embed.wte.weight", "head.lm_head.weight"):
        if name in weights:
            pad = cfg.padded_vocab_size - v
            weights[name] = torch.cat([weights[name], weights[name].new_zeros(pad, h)])
    if checkpoint.latest(out_dir) is not None:
        raise ValueError(f"--out-dir {out_dir} already holds a checkpoint; choose an empty one")
    os.makedirs(out_dir, exist_ok=True)
    hf.save_dense(out_dir, cfg, weights, dict(imported_from=os.path.abspath(src)))
    return cfg


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="checkpoint (any layout) -> DCP, torchtitan's Llama names")
    e.add_argument("--out-dir", default="out")
    e.add_argument("--to", required=True)
    i = sub.add_parser("import", help="DCP of torchtitan's Llama names -> step-0 checkpoint")
    i.add_argument("src")
    i.add_argument("--out-dir", required=True)
    i.add_argument("--n-head", type=int, required=True, help="query heads (DCP does not say)")
    i.add_argument("--n-kv-head", type=int, default=0, help="0: from wk's rows")
    i.add_argument("--rope-theta", type=float, default=500000.0, help="Llama 3's: 500000")
    i.add_argument("--norm-eps", type=float, default=1e-5)
    i.add_argument("--block-size", type=int, default=8192, help="the context (Llama 3's: 8192)")
    args = p.parse_args(argv)
    if args.cmd == "export":
        export(args.out_dir, args.to)
        print(f"wrote {args.to}: torch.distributed.checkpoint, torchtitan's Llama names")
        return
    cfg = import_(
        args.src, args.out_dir, args.n_head, args.rope_theta, args.n_kv_head, args.norm_eps
    )
    print(
        f"wrote a step-0 checkpoint to {args.out_dir}/ckpt; fine-tune with:\n  python "
        f"nanomega/train.py --resume --out-dir {args.out_dir} {hf.train_flags(cfg)} --tokenizer FILE"
    )


if __name__ == "__main__":
    lifecycle.entrypoint(main)
