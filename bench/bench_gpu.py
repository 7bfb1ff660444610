"""GPU training speed: GPT-2 124M in bf16, nanomega (--attention sdpa | eager | fused, --compile off |
on) against a plain PyTorch GPT of the same shape (compile off | on), in one process.

    python bench/bench_gpu.py                     # one GPU; prints a RESULTS table (markdown)
    python bench/bench_gpu.py --steps 20 --batch-size 8 --attentions sdpa,eager --compiles 0,1

nanomega's configurations are built as train.py builds them (compose.build: the dense GPT, recompute
none, bf16 model, ZeroEngine stage 0 on a world of one, AdamW, clip 1.0); the plain one is nanoGPT's
recipe (bench/bench_step_vs_plain.py's PlainGPT: nn.Linear, SDPA, tied head; fp32 weights under
bf16 autocast, fused AdamW, clip 1.0). Random tokens; 3 warm-up steps (the compile, if any, happens
there and is reported apart), then `--steps` timed steps, the optimizer's included: the timer stops
after torch.cuda.synchronize(). Each row is printed as soon as it is measured; a configuration that
fails (out of memory or anything else) prints its error and the next one runs.

MFU by llm.c's formula (llmc_flops_per_token below) over the datasheet's dense bf16 peak (meter.py),
so that it compares with llm.c's own MFU; memory = max allocated, with what was still allocated
when the configuration started (should read 0.0: see release()).
Written without a GPU at hand: its first results go to bench/RESULTS.md with the GPU's name.
"""

import argparse
import dataclasses
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanomega.job import flags  # noqa: E402
from nanomega import compose, dist, train  # noqa: E402
from nanomega.job import meter  # noqa: E402
from bench_step_vs_plain import PlainGPT  # noqa: E402

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
VOCAB = 50257  # GPT-2's
PADDED = 50304  # a multiple of 128, as nanomega pads it (the plain model is given it directly)


def llmc_flops_per_token(n_params, n_layer, n_embd, seq):
    """llm.c's estimate (train_gpt2.cu, gpt2_estimate_mfu): 6 N for every weight's matmuls forward
    and backward (N all parameters, the tied embedding once, as llm.c counts them) plus 6 L h s for
    attention's two matmuls (PaLM's 12 L h s halved: causal attention does half of them)."""
    return 6 * n_params + 6 * n_layer * n_embd * seq


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


def measure(step, steps, device):
    """(seconds per step, warm-up seconds): 3 warm-up steps, then `steps` timed ones; the clock
    stops after a device sync, so the last optimizer step's kernels are inside it."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warmup = time.perf_counter() - t0
    meter.reset_peak_memory(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps, warmup


def nanomega_step(attention, compile_, batch, grid):
    """(step, parameters) of nanomega's trainer for this configuration."""
    args = flags.parse(
        [*GPT2, "--batch-size", str(batch), "--attention", attention]
        + (["--compile"] if compile_ else [])
    )
    # compose.build reads the shape from the Config
    args = dataclasses.replace(args, vocab_size=VOCAB)
    torch.manual_seed(0)
    model, engine, n_params = compose.build(args, grid)
    x = torch.randint(0, VOCAB, (batch, 1024), device=grid.device)

    def step():
        train.forward_backward(model, engine, grid, [(x, x)], args, loss_scale=1.0)
        engine.step(clip_norm=1.0)

    return step, n_params


def plain_step(compile_, batch, device):
    """(step, parameters) of the plain nanoGPT-style GPT of the same shape (padded vocabulary)."""
    torch.manual_seed(0)
    plain = PlainGPT(PADDED, 1024, 12, 12, 768).to(device)
    fwd = torch.compile(plain) if compile_ else plain
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    x = torch.randint(0, VOCAB, (batch, 1024), device=device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, sum(p.numel() for p in plain.parameters())


def row(model, attention, compile_, make, batch, steps, device, peak):
    """One table row: build, measure, format; an error is the row's text, not the end of the run."""
    before = torch.cuda.memory_allocated(device) / 2**30  # left by earlier ones: 0 after release()
    head = f"| {model} | {attention} | {'on' if compile_ else 'off'} |"
    try:
        step, n_params = make()
        dt, warmup = measure(step, steps, device)
    except Exception as e:  # OOM, a compile error, a kernel's launch failure: say which
        return f"{head} {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | | | |"
    tok_s = batch * 1024 / dt
    mfu = llmc_flops_per_token(n_params, 12, 768, 1024) * tok_s / peak
    mem = meter.peak_memory_gib(device)
    return (
        f"{head} {1e3 * dt:.1f} ms | {tok_s:,.0f} | {100 * mfu:.1f}% | {mem:.1f} GiB | "
        f"{before:.2f} GiB | {warmup:.1f} s |"
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
    peak, source = meter.peak_flops(grid.device, torch.bfloat16)

    # the header first, then each row as it is measured: a run cut short keeps what it measured
    print(
        f"RESULTS: GPT-2 124M, bf16, batch {a.batch_size} x 1024 tokens, {a.steps} timed steps, "
        f"{name}, torch {torch.__version__}; MFU: llm.c's 6N + 6Lhs per token over {source}"
    )
    print(
        "| model | attention | compile | step | tokens/s | MFU | max allocated | allocated at start "
        "| warm-up (3 steps) |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    compiles = [bool(int(c)) for c in a.compiles.split(",")]
    configs = [
        ("nanomega", att, c, lambda att=att, c=c: nanomega_step(att, c, a.batch_size, grid))
        for att in a.attentions.split(",")
        for c in compiles
    ]
    configs += [
        ("plain", "sdpa", c, lambda c=c: plain_step(c, a.batch_size, grid.device)) for c in compiles
    ]
    for model, attention, compile_, make in configs:
        print(
            row(model, attention, compile_, make, a.batch_size, a.steps, grid.device, peak),
            flush=True,
        )
        release(grid.device)  # after row(): its frames, and an error's traceback, are gone


if __name__ == "__main__":
    main()
