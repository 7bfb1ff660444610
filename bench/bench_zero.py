"""ZeRO stages 0-3 (nanomega.zero) against PyTorch's DDP, ZeroRedundancyOptimizer (+DDP) and FSDP2
fully_shard.

One GPT, data parallel over 2 CPU ranks (gloo, one thread each), fp32, AdamW (decay on matrices
only), gradients clipped at 1.0, one micro-batch per step. FSDP2 shards each block and the root
(embedding and head), as our default wrap does. Measured per rank:
  step time    median over --steps steps, the seven implementations alternating step by step (max over ranks)
  peak memory  the process's peak RSS during one step (after a warm-up step, so Adam's state exists) above
               its RSS just before the model was built; each implementation in a fresh world of its own
               (in a shared one the later ones find gloo's buffers already allocated), started with
               MALLOC_MMAP_THRESHOLD_=65536 so freed tensors go back to the kernel; /proc/self/clear_refs
               resets the peak (bench_pp.rss_peak_rise's trick)
  between steps the bytes of the live tensors reachable from the model and the optimizer after a step (each
               storage once; a DTensor's local shard): parameters, gradients, optimizer state -- what a
               rank keeps from one step to the next (torch DDP's internal gradient buckets are not reachable
               this way and not counted)
  model states ours only: engine.memory_bytes() during the step (after backward: parameters + gradients +
               optimizer), exact
Usage: python bench/bench_zero.py [--steps 5] [--memory-only]
"""

import argparse
import gc
import os
import re
import statistics

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from bench_pp import timed
from nanomega import dist, worlds
from nanomega.flat import storage_bytes
from nanomega.zero import ZeroEngine
from nanomega.zero_rules import weight_decay_groups
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT

CFG = dict(vocab_size=8192, block_size=128, n_layer=4, n_head=8, n_embd=512)
MB, LR, WD = 4, 1e-4, 0.1
NAMES = (
    "zero-0",
    "zero-1",
    "zero-2",
    "zero-3",
    "torch DDP",
    "torch DDP+ZeroRedundancyOptimizer",
    "torch FSDP2",
)


def _groups(model):
    decay = weight_decay_groups(WD, lr=LR)([(k, p) for k, p in model.named_parameters()])
    by_name = dict(model.named_parameters())
    return [dict(g, params=[by_name[k] for k in g["params"]]) for g in decay]


def build(name, grid):
    """(model, step) for one implementation; step() runs forward, backward, clip, optimizer step."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    g = torch.Generator().manual_seed(grid.rank)
    idx = torch.randint(CFG["vocab_size"], (MB, CFG["block_size"]), generator=g)
    targets = idx.roll(-1, 1)
    if name.startswith("zero-"):
        engine = ZeroEngine(
            model, torch.optim.AdamW, weight_decay_groups(WD, lr=LR), grid, int(name[-1])
        )

        def step():
            model(idx, targets).backward()
            engine.states = sum(engine.memory_bytes().values())  # at the step: gradients reduced
            engine.step(clip_norm=1.0)

        return engine, step
    if name == "torch FSDP2":
        mesh = DeviceMesh.from_group(grid.dp.group, "cpu")
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped, opt = model, torch.optim.AdamW(_groups(model))
    else:
        wrapped = DistributedDataParallel(model, process_group=grid.dp.group)
        opt = (
            torch.optim.AdamW(_groups(model))
            if name == "torch DDP"
            else ZeroRedundancyOptimizer(
                _groups(model)[0]["params"],
                torch.optim.AdamW,
                process_group=grid.dp.group,
                lr=LR,
                weight_decay=WD,
            )
        )
        if name != "torch DDP":
            opt.add_param_group(_groups(model)[1])

    def step():
        wrapped(idx, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.model, step.optimizer = model, opt
    return None, step


def live_bytes(model, optimizer):
    """Bytes of the tensors reachable from model and optimizer (each storage once; DTensors: the
    local shard)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the local AdamW
    state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    tensors = (
        [local(p) for p in model.parameters()]
        + [local(p.grad) for p in model.parameters() if p.grad is not None]
        + [local(t) for t in state]
    )
    return storage_bytes(tensors, set())


def _rss(field="VmRSS"):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def time_world(n):
    grid = dist.Grid(2, 1, 1)
    steps = {name: build(name, grid)[1] for name in NAMES}
    for fn in steps.values():
        fn()  # warm-up
    times = {name: [] for name in NAMES}
    for _ in range(n):
        for name, fn in steps.items():
            times[name].append(timed(grid.dp, fn))
    return {name: statistics.median(v) for name, v in times.items()}


def memory_world(name):
    grid = dist.Grid(2, 1, 1)
    gc.collect()
    base = _rss()
    engine, step = build(name, grid)
    step()  # warm-up: gradients and optimizer state exist from here on
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current RSS
    step()
    between = (
        sum(engine.memory_bytes().values()) if engine else live_bytes(step.model, step.optimizer)
    )
    return dict(
        peak=_rss("VmHWM") - base, states=engine.states if engine else None, between=between
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--memory-only",
        action="store_true",
        help="skip the step times (memory does not depend on load)",
    )
    args = ap.parse_args()
    n_params = sum(p.numel() for p in GPT(GPTConfig(**CFG)).parameters())
    print(
        f"model {CFG} ({n_params / 1e6:.1f}M parameters), micro-batch {MB}x{CFG['block_size']} per rank, dp=2, "
        f"fp32, 1 thread per rank, torch {torch.__version__}, load average before {os.getloadavg()[0]:.1f}"
    )
    timing = (
        {name: float("nan") for name in NAMES}
        if args.memory_only
        else worlds.launch(time_world, 2, args.steps, timeout=3000)[0]
    )
    # read by the spawned ranks' allocator at start-up
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    per_name = {name: worlds.launch(memory_world, 2, name, timeout=1800) for name in NAMES}
    memory = [{name: ranks[r] for name, ranks in per_name.items()} for r in range(2)]
    print(
        f"load average after {os.getloadavg()[0]:.1f} (other processes on these 2 cores skew the times)"
    )
    mib, ddp = 2**20, "torch DDP"
    print(
        f"{'implementation':34s} {'step ms':>8s} {'vs DDP':>7s} {'peak MiB r0':>12s} {'r1':>7s} {'vs DDP':>7s} "
        f"{'between MiB':>12s} {'vs FSDP2':>8s} {'states MiB':>11s}"
    )
    for name in NAMES:
        peaks = [m[name]["peak"] for m in memory]
        states = memory[0][name]["states"]
        between = memory[0][name]["between"]
        print(
            f"{name:34s} {timing[name] * 1e3:8.0f} {timing[name] / timing[ddp]:7.2f} {peaks[0] / mib:12.1f} "
            f"{peaks[1] / mib:7.1f} {max(peaks) / max(m[ddp]['peak'] for m in memory):7.2f} "
            f"{between / mib:12.1f} {between / memory[0]['torch FSDP2']['between']:8.2f} "
            f"{states / mib if states else float('nan'):11.1f}"
        )


if __name__ == "__main__":
    main()
