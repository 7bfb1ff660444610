"""Mixed precision x activation recompute on CPU: step time and peak memory, fp32/bf16 x
none/selective/full.

One process, a world of one, zero.ZeroEngine (fp32 masters) + AdamW, as train.py composes them. Per
config:
  step time     median wall time and minimum CPU time (time.process_time, one thread: the least disturbed
                by other processes sharing the cores) over --steps optimizer steps, after a warm-up; the
                three modes' steps alternate
  peak memory   the rise of the kernel's peak RSS (VmHWM, reset through /proc/self/clear_refs) during one
                step, the allocator returning every freed tensor to the kernel (MALLOC_MMAP_THRESHOLD_=65536,
                set by re-executing this script); and the peak bytes autograd saved (recompute.ActivationMeter:
                it does not see the one layer a full recompute rebuilds inside backward)
  formula       per-layer saved bytes from formulas.activation_bytes_per_layer with CPU bytes per
                element, x n_layer
                (printed for dropout > 0 only, the formula's assumption)
Usage: python bench/bench_precision_recompute.py [--steps 5] [--threads 1] [--dropout 0.1]
"""

import argparse
import os
import statistics
import sys
import time

import torch

from bench_pp import rss_peak_rise
from nanomega import dist
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.precision import DTYPES, cast_model
from nanomega.formulas import activation_bytes_per_layer
from nanomega.recompute import ActivationMeter, apply_recompute
from nanomega.zero import ZeroEngine

CFG = dict(vocab_size=256, block_size=512, n_layer=4, n_head=8, n_embd=256)
BATCH = 4
MODES = ("none", "selective", "full")


def setup(dtype, mode, dropout):
    """The model and its engine; returns (model, step), after one warm-up step (buffers and state
    exist)."""
    torch.manual_seed(0)
    model = cast_model(apply_recompute(GPT(GPTConfig(**CFG, dropout=dropout)), mode), dtype)
    engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-4), dist.Grid(1, 1, 1))
    x = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"]))

    def step():
        model(x, x).backward()
        engine.step()

    step()
    return model, step


def measure(dtype, steps, dropout):
    """The three modes' steps alternate (none, selective, full, none, ...) so that a burst of load
    from other processes hits all of them alike."""
    runs = {mode: setup(dtype, mode, dropout) for mode in MODES}
    wall, cpu = {m: [] for m in MODES}, {m: [] for m in MODES}
    for _ in range(steps):
        for mode, (_, step) in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            wall[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
    out = {}
    for mode, (model, step) in runs.items():
        rise = rss_peak_rise(step)
        with ActivationMeter(model) as meter:
            step()
        s, h, a, e = CFG["block_size"], CFG["n_embd"], CFG["n_head"], dtype.itemsize
        # the formula assumes dropout > 0 (the masks, and dropped probabilities apart from the
        # softmax output)
        layer = activation_bytes_per_layer(s, BATCH, h, a, recompute=mode, act=e, mask=e, probs=4)
        formula = CFG["n_layer"] * layer if dropout else 0
        out[mode] = dict(
            wall=statistics.median(wall[mode]),
            cpu=min(cpu[mode]),
            rss=rise,
            saved=meter.peak,
            formula=formula,
        )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.1)
    args = p.parse_args()
    # the allocator reads it at start-up only
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        os.execve(
            sys.executable,
            [sys.executable] + sys.argv,
            dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"),
        )
    torch.set_num_threads(args.threads)
    dist.init("cpu")
    print(
        f"{CFG}, dropout {args.dropout}, batch {BATCH}, {args.threads} thread(s), "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'dtype':>5} {'recompute':>9} | {'wall ms':>8} {'CPU ms':>8} {'x none':>6} | {'RSS rise MB':>11} "
        f"{'saved MB':>8} {'formula MB':>10} {'x none':>6}"
    )
    for name in ("fp32", "bf16"):
        results = measure(DTYPES[name], args.steps, args.dropout)
        ref = results["none"]
        for mode, r in results.items():
            formula = f"{r['formula'] / 2**20:.1f}" if r["formula"] else "-"
            print(
                f"{name:>5} {mode:>9} | {r['wall'] * 1e3:8.0f} {r['cpu'] * 1e3:8.0f} "
                f"{r['cpu'] / ref['cpu']:6.2f} | {r['rss'] / 2**20:11.1f} {r['saved'] / 2**20:8.1f} "
                f"{formula:>10} {r['rss'] / ref['rss']:6.2f}",
                flush=True,
            )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
