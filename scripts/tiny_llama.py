"""A small random Llama in Hugging Face's format, made offline: the start of the README's Llama
import flow.

    python scripts/tiny_llama.py tiny-llama                      # config.json, model.safetensors, tokenizer.json
    python -m nanomega.tools.hf import tiny-llama --out-dir ft   # -> a step-0 checkpoint and the train.py line

Idea: transformers builds a LlamaForCausalLM from a config alone (its own random init, std 0.02), so
the whole import -> fine-tune -> sample -> export path runs on a machine that cannot download
Llama's weights. The shape is Llama 3's in miniature: grouped-query attention (4 query heads sharing
2 key/value heads), SwiGLU of width 3h, rope_theta 500,000, RMSNorm eps 1e-5, an untied head. The
tokenizer is our shakespeare-4k, written as an HF tokenizer.json by nanomega.tools.tokenizer.to_hf
(byte-level BPE, GPT-2's split pattern, <|endoftext|> = id 4095): `import` turns it back into a
.tiktoken file for --tokenizer. (A real Llama 3 tokenizer splits with another pattern than GPT-2's,
which data.get_tokenizer cannot: import refuses it in one line.)
"""

import argparse
import os
import sys

import torch
import transformers  # the hf extra: pip install 'nanomega[hf]'

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanomega import data  # noqa: E402
from nanomega.tools import tokenizer  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", nargs="?", default="tiny-llama")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128, help="max_position_embeddings")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    enc = data.get_tokenizer("shakespeare-4k")
    cfg = transformers.LlamaConfig(
        vocab_size=enc.n_vocab,
        hidden_size=args.n_embd,
        intermediate_size=3 * args.n_embd,
        num_hidden_layers=args.n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.block_size,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=enc.eot_token,
        eos_token_id=enc.eot_token,
    )
    torch.manual_seed(args.seed)  # transformers draws the weights from torch's default generator
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(args.folder)
    tokenizer.to_hf(enc).save_pretrained(args.folder)
    n = sum(t.numel() for t in model.parameters())
    print(
        f"wrote {args.folder}: a random LlamaForCausalLM of {n:,} parameters ({args.n_layer} layers, h "
        f"{args.n_embd}, 4 query / 2 key-value heads, vocabulary {enc.n_vocab}) with the shakespeare-4k tokenizer"
    )


if __name__ == "__main__":
    main()
