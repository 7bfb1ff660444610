"""GPU training speed: GPT-2 124M in bf16, --attention sdpa | eager | fused, --compile off | on.

    python bench/bench_gpu.py                     # one GPU; prints a RESULTS table (markdown)
    python bench/bench_gpu.py --steps 20 --batch-size 8 --attentions sdpa,eager --compiles 0,1

Each configuration is built as train.py builds it (compose.build: the dense GPT, recompute none,
bf16 model, ZeroEngine stage 0 on a world of one, AdamW, clip 1.0) on random tokens, runs 3 warm-up
steps (the compile, if any, happens there and is reported separately), then `--steps` timed steps
with torch.cuda.synchronize.
MFU = 6N' + 12Lhs FLOPs/token x tokens/s / the datasheet peak (meter.py); memory = max allocated,
with what was still allocated when the configuration started (should read 0.0: see release()).
Written without a GPU at hand: its first results go to bench/RESULTS.md with the GPU's name when
run.
"""

import argparse
import dataclasses
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanomega.job import flags  # noqa: E402
from nanomega import compose, dist, train  # noqa: E402
from nanomega.job import meter  # noqa: E402
from nanomega.formulas import model_flops_per_token as flops_per_token  # noqa: E402

GPT2 = [
    "--n-layer",
    "12",
    "--n-head",
    "12",
    "--n-embd",
    "768",
    "--block-size",
    "1024",
    "--dropout",
    "0",
    "--dtype",
    "bf16",
]
VOCAB = 50257  # GPT-2's; padded to 50304 (a multiple of 128)


def release(device):
    """Free the last configuration before the next is measured. The engine and its parameters
    reference each other (a cycle), so `del` frees nothing until gc.collect(); compiled graphs are
    dropped with the compiler's caches; then the allocator's cached blocks go back and the peak
    counter restarts."""
    gc.collect()
    torch.compiler.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def run(attention, compile_, batch, steps, grid):
    # left by earlier configurations: 0 after release()
    before = torch.cuda.memory_allocated(grid.device) / 2**30
    args = flags.parse(
        [*GPT2, "--batch-size", str(batch), "--attention", attention]
        + (["--compile"] if compile_ else [])
    )
    # compose.build reads the shape from the Config
    args = dataclasses.replace(args, vocab_size=VOCAB)
    cfg = flags.model_config(args)
    torch.manual_seed(0)
    model, engine, n_params = compose.build(args, grid)
    x = torch.randint(0, VOCAB, (batch, cfg.block_size), device=grid.device)

    def step():
        loss = train.forward_backward(model, engine, grid, [(x, x)], args, loss_scale=1.0)
        engine.step(clip_norm=1.0)
        return loss

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warmup = time.perf_counter() - t0
    meter.reset_peak_memory(grid.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss = loss.item()  # synchronizes
    dt = (time.perf_counter() - t0) / steps
    tok_s = batch * cfg.block_size / dt
    peak, source = meter.peak_flops(grid.device, torch.bfloat16)
    return dict(
        step_ms=1e3 * dt,
        tok_s=tok_s,
        mfu=meter.mfu(flops_per_token(cfg), tok_s, 1, peak),
        mem=meter.peak_memory_gib(grid.device),
        before=before,
        warmup_s=warmup,
        loss=loss,
        params=n_params,
        source=source,
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--attentions", default="sdpa,eager,fused")
    p.add_argument("--compiles", default="0,1")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    dist.init("cuda")
    grid = dist.Grid(1, 1, 1)
    name = torch.cuda.get_device_name(grid.device)
    rows = []
    for attention in a.attentions.split(","):
        for compile_ in map(int, a.compiles.split(",")):
            try:
                r = run(attention, bool(compile_), a.batch_size, a.steps, grid)
            except torch.OutOfMemoryError:
                r = None
            # after the except block: its traceback no longer holds run()'s frame
            release(grid.device)
            rows.append((attention, compile_, r))
            print(f"{attention} compile={compile_}: {r}", file=sys.stderr, flush=True)
    print(
        f"\nRESULTS: GPT-2 124M, bf16, batch {a.batch_size} x 1024 tokens, {a.steps} timed steps, {name}, "
        f"torch {torch.__version__}; peak: {rows[0][2]['source'] if rows[0][2] else '?'}"
    )
    print(
        "| attention | compile | step | tokens/s | MFU | max allocated | allocated at start | warm-up (3 steps) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for attention, compile_, r in rows:
        if r is None:
            print(f"| {attention} | {'on' if compile_ else 'off'} | out of memory | | | | | |")
            continue
        print(
            f"| {attention} | {'on' if compile_ else 'off'} | {r['step_ms']:.1f} ms | {r['tok_s']:,.0f} | "
            f"{100 * r['mfu']:.1f}% | {r['mem']:.1f} GiB | {r['before']:.2f} GiB | {r['warmup_s']:.1f} s |"
        )


if __name__ == "__main__":
    main()
