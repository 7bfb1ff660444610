"""Generate text from a checkpoint saved under any layout.

    python -m nanomega.tools.sample --out-dir out --prompt "ROMEO:"

Autoregressive sampling: run the model on the context (the last block_size tokens), take the last
position's logits, divide by the temperature, keep the top k, sample, append, repeat.
reshard.full_weights rebuilds the full tensors of any layout.
Lesson: lessons/01-dense-model.md
"""

import argparse
import os
import sys

import torch

if __package__ in (None, ""):  # `python nanomega/tools/sample.py`: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from nanomega import checkpoint, data, moe, reshard
from nanomega.job import faults, lifecycle
from nanomega.model import GPT


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
    """idx (b, t) -> (b, t + max_new_tokens). Padded vocabulary entries are never sampled."""
    model.eval()
    vocab = model.cfg.vocab_size
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.cfg.block_size :])[:, -1, :vocab].float()  # (b, V)
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, vocab)).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def load_model(out_dir):
    """(GPT, tokenizer name) of out_dir's newest checkpoint."""
    folder, cfg, tokenizer, skipped = checkpoint.saved_model(out_dir)  # the newest that verifies
    for reason in skipped:
        faults.say(f"sample: skipped {reason}")
    # shapes only: the checkpoint's weights are assigned, nothing is drawn first
    with torch.device("meta"):
        model = GPT(cfg, seed=0)
    weights = reshard.full_weights(folder)  # saved under any tp x pp x dp x ZeRO layout
    if cfg.tie_embeddings:
        weights["head.lm_head.weight"] = weights["embed.wte.weight"]
    # buffers, set below
    weights |= {k: b for k, b in model.state_dict().items() if k.endswith("expert_bias")}
    model.load_state_dict(weights, assign=True)
    if cfg.n_experts:  # the routing biases: buffers, saved beside the pieces (moe.bias_table)
        moe.load_bias_table(model, checkpoint.load_shard(folder, 0).get("moe_bias"))
    return model, tokenizer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="out")
    p.add_argument("--prompt", default="\n")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=100)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--num-samples", type=int, default=1)
    args = p.parse_args(argv)

    if args.temperature < 0 or args.max_new_tokens < 0 or args.top_k < 0:
        raise ValueError("--temperature, --max-new-tokens and --top-k must be >= 0")

    model, tokenizer = load_model(args.out_dir)
    enc = data.get_tokenizer(tokenizer)
    ids = enc.encode(args.prompt, allowed_special="all") or [enc.eot_token]
    gen = torch.Generator().manual_seed(args.seed)

    for _ in range(args.num_samples):
        out = generate(
            model, torch.tensor([ids]), args.max_new_tokens, args.temperature, args.top_k, gen
        )
        print(enc.decode(out[0].tolist()))
        print("-" * 40)


def cli():
    """The console script (pyproject [project.scripts])."""
    lifecycle.entrypoint(main)  # bad input: one line, exit 2


if __name__ == "__main__":
    cli()
