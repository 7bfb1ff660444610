"""nanomega's training step vs a plain-PyTorch GPT with SDPA of the same shape, on CPU, interleaved.

    python bench/bench_step_vs_plain.py                 # L4, 4 heads, d128, T128, batch 8, V4096, fp32
    python bench/bench_step_vs_plain.py --compile       # also: first-step compile time, steady state

nanomega: the trainer's own pieces (compose.build: the dense GPT with --attention, ZeroEngine stage
0 on a world of one, forward_backward + engine.step with clip 1.0). Plain: a nanoGPT-style model
(nn.Linear, F.scaled_dot_product_attention(is_causal=True), tied head), loss.backward(),
clip_grad_norm_(1.0), torch.optim.AdamW. The two alternate step by step at each thread count, so a
load from other processes falls on both alike; the table gives the median and minimum step times,
their ratios, and the median of the ratios of adjacent pairs (robust to a load that changes during
the run).
"""

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanomega.job import flags  # noqa: E402
from nanomega import compose, dist, train  # noqa: E402


class PlainBlock(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.c_attn, self.c_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (
            self.c_attn(self.ln_1(x))
            .view(b, s, 3, self.heads, h // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.c_proj(y)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, vocab, block, layers, heads, h):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(block, h)
        self.blocks = nn.ModuleList(PlainBlock(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(
                    p, std=0.02 / math.sqrt(2 * layers) if p.shape[0] != vocab else 0.02
                )

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30, help="timed steps per model per thread count")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--attention", default="sdpa")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    shape = [
        "--n-layer",
        "4",
        "--n-head",
        "4",
        "--n-embd",
        "128",
        "--block-size",
        "128",
        "--batch-size",
        "8",
        "--dropout",
        "0",
        "--attention",
        a.attention,
    ] + (["--compile"] if a.compile else [])
    args = flags.parse(shape)
    dist.init("cpu")
    grid = dist.Grid(1, 1, 1)
    model, engine, n_params = compose.build(args, grid)
    torch.manual_seed(0)
    plain = PlainGPT(4096, 128, 4, 4, 128)
    if a.compile:
        for block in plain.blocks:
            block.compile()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    x = torch.randint(0, 4096, (8, 128), generator=torch.Generator().manual_seed(0))

    def nano_step():
        train.forward_backward(model, engine, grid, [(x, x)], args, loss_scale=1.0).item()
        engine.step(clip_norm=1.0)

    def plain_step():
        plain(x, x).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    # first steps (and compiles) apart
    for name, fn in (("nanomega", nano_step), ("plain", plain_step)):
        t0 = time.perf_counter()
        fn()
        print(f"{name}: first step {time.perf_counter() - t0:.2f} s")
    print(
        f"CPU: {cpu_name()}, torch {torch.__version__}, nanomega {n_params / 1e6:.2f}M params, "
        f"plain {sum(q.numel() for q in plain.parameters()) / 1e6:.2f}M; attention {a.attention}"
        f"{', compiled blocks' if a.compile else ''}"
    )
    print(
        "| threads | nanomega median | plain median | ratio (median) | ratio (paired) | nanomega min | plain min | "
        "ratio (min) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for threads in map(int, a.threads.split(",")):
        torch.set_num_threads(threads)
        times = {"nanomega": [], "plain": []}
        for _ in range(3):  # warm-up at this thread count
            nano_step()
            plain_step()
        for _ in range(a.steps):
            for name, fn in (("nanomega", nano_step), ("plain", plain_step)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        low = {k: min(v) for k, v in times.items()}
        # each step against the plain step right after it: a load that drifts over the run falls on
        # both alike
        paired = statistics.median(a / b for a, b in zip(times["nanomega"], times["plain"]))
        print(
            f"| {threads} | {1e3 * med['nanomega']:.1f} ms | {1e3 * med['plain']:.1f} ms | "
            f"{med['nanomega'] / med['plain']:.3f} | {paired:.3f} | {1e3 * low['nanomega']:.1f} ms | "
            f"{1e3 * low['plain']:.1f} ms | {low['nanomega'] / low['plain']:.3f} |",
            flush=True,
        )


def cpu_name():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({torch.backends.cpu.get_cpu_capability()})"
    return torch.backends.cpu.get_cpu_capability()


if __name__ == "__main__":
    main()
