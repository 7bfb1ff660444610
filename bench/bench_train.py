"""Single-process training speed: step time, tokens/s and MFU against this machine's measured matmul
peak.

    python bench/bench_train.py            # the README's default model (4 layers, 128 wide, 128 tokens, batch 16)
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanomega.formulas import model_flops_per_token as flops_per_token  # noqa: E402
from nanomega.gpt_config import GPTConfig  # noqa: E402
from nanomega.model import GPT  # noqa: E402
from nanomega.job import meter  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = p.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size
    )
    model = GPT(cfg).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.block_size))
    times = []
    for _i in range(args.steps + 3):  # 3 warm-up steps
        t0 = time.perf_counter()
        model(x, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    step = sorted(times[3:])[len(times[3:]) // 2]  # median
    tok_s = args.batch_size * args.block_size / step
    peak, _ = meter.peak_flops("cpu", dtype)  # the trainer's own measurement, in this dtype
    mfu = flops_per_token(cfg) * tok_s / peak
    print(
        f"{args.dtype} {torch.get_num_threads()} threads, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
        f"params: step {1e3 * step:.1f} ms (median of {args.steps}), {tok_s:,.0f} tokens/s, "
        f"{flops_per_token(cfg) / 1e6:.2f} MFLOP/token, matmul peak {peak / 1e9:.0f} GFLOP/s, MFU {100 * mfu:.1f}%"
    )


if __name__ == "__main__":
    main()
