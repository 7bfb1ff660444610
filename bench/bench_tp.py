"""Tensor parallelism: nanomega.tp against torch.distributed.tensor.parallel
(ColwiseParallel/RowwiseParallel).

Same dense GPT sliced at tp = 2 both ways, 2 CPU ranks with one thread each. Torch's plan: the token
embedding RowwiseParallel (vocab-sharded, all-reduced), c_attn and c_fc ColwiseParallel, both c_proj
RowwiseParallel, the tied LM head ColwiseParallel with vocab-sharded logits and torch's
loss_parallel() cross-entropy -- the same math and the same collectives as ours. Torch shards output
features contiguously, so c_attn's rows are reordered (3, t, heads/t, hd) -> (t, 3, heads/t, hd)
first to give each rank whole heads of q, k and v.
Measured per step (forward, backward, AdamW):
  step time     median over --steps steps, the implementations alternating step by step
  peak memory   rise of the process's peak RSS during one step (bench_pp.rss_peak_rise, in a second world
                started with MALLOC_MMAP_THRESHOLD_=65536 so freed tensors go back to the kernel), and the
                bytes autograd saved for backward
Ours with sequence parallelism is a third row (not compared: torch's SequenceParallel plan is not
built here).
Usage: python bench/bench_tp.py [--steps 10]
"""

import argparse
import os
import statistics

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from bench_pp import rss_peak_rise, timed
from nanomega import dist, tp, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT

CFG = dict(
    vocab_size=4096,
    block_size=256,
    n_layer=4,
    n_head=8,
    n_embd=512,
    make_vocab_size_divisible_by=256,
)
MB = 4
NAMES = ("ours", "torch", "ours+sp")


def torch_tensor_parallel(model, grid):
    """The same slicing through PyTorch's DTensor plans (in place)."""
    t, r = grid.tp.size, grid.tp.rank
    plan = {
        "embed.wte": RowwiseParallel(input_layouts=Replicate()),
        "head.lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for key, block in model.blocks.items():
        attn, mlp = block.attn, block.mlp
        with torch.no_grad():
            for p in (attn.c_attn.weight, attn.c_attn.bias):
                p.copy_(p.unflatten(0, (3, t, -1)).transpose(0, 1).flatten(0, 2))
        attn.n_head //= t
        # outside torch's plan
        mlp.fc_bias = torch.nn.Parameter(mlp.fc_bias.detach().chunk(t)[r].clone())
        plan.update(
            {
                f"blocks.{key}.attn.c_attn": ColwiseParallel(),
                f"blocks.{key}.attn.c_proj": RowwiseParallel(),
                f"blocks.{key}.mlp.c_fc": ColwiseParallel(),
                f"blocks.{key}.mlp.c_proj": RowwiseParallel(),
            }
        )
    parallelize_module(model, DeviceMesh.from_group(grid.tp.group, "cpu"), plan)
    # parallelize_module made two DTensors: tie them again
    model.head.lm_head.weight = model.embed.wte.weight
    return model


def _setup(grid):
    cfg = GPTConfig(**CFG)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(cfg.vocab_size, (MB, cfg.block_size), generator=g)
    targets = idx.roll(-1, 1)
    steps = {}
    for name in NAMES:
        torch.manual_seed(0)
        model = GPT(cfg)
        if name == "torch":
            torch_tensor_parallel(model, grid)
        else:
            tp.apply_tensor_parallel(model, grid.tp, sequence_parallel=name == "ours+sp")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt, parallel_loss=name == "torch"):
            with loss_parallel() if parallel_loss else torch.enable_grad():
                loss = model(idx, targets)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()

        steps[name] = (model, step)
    return steps


def time_world(n):
    grid = dist.Grid(1, 1, 2)
    steps = _setup(grid)
    # warm-up; the loss of the same first step
    first = {name: fn() for name, (_, fn) in steps.items()}
    times = {name: [] for name in steps}
    for _ in range(n):
        for name, (_, fn) in steps.items():
            times[name].append(timed(grid.tp, fn))
    return dict(loss=first, **{name: statistics.median(v) for name, v in times.items()})


def saved_bytes(model, fn):
    """Bytes autograd saves for backward during fn(): each storage once, parameters skipped
    (DTensors by their local shard)."""
    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t
    skip = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = local(t).untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def memory_world():
    grid = dist.Grid(1, 1, 2)
    steps = _setup(grid)
    for _, fn in steps.values():
        fn()  # warm-up: gradients and optimizer state exist from here on
    return {
        name: dict(rss=rss_peak_rise(fn), saved=saved_bytes(model, fn))
        for name, (model, fn) in steps.items()
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    print(
        f"model {CFG}, micro-batch {MB}x{CFG['block_size']}, tp=2, 1 thread per rank, torch {torch.__version__}, "
        f"load average before {os.getloadavg()[0]:.1f}"
    )
    timing = worlds.launch(time_world, 2, args.steps, timeout=1800)[0]
    # read by the spawned ranks' allocator at start-up
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    memory = worlds.launch(memory_world, 2, timeout=1200)
    print(
        f"load average after {os.getloadavg()[0]:.1f} (other processes on these 2 cores skew the times)"
    )
    mib = 2**20
    for name in NAMES:
        saved, rss = memory[0][name]["saved"], [m[name]["rss"] / m["torch"]["rss"] for m in memory]
        print(
            f"{name:8s} loss {timing['loss'][name]:.6f}  step {timing[name] * 1e3:7.1f} ms "
            f"(x{timing[name] / timing['torch']:.3f} torch)  saved activations {saved / mib:5.1f} MiB "
            f"(x{saved / memory[0]['torch']['saved']:.3f})  peak RSS rise rank 0 "
            f"{memory[0][name]['rss'] / mib:5.1f} MiB (x{rss[0]:.3f}), rank 1 (x{rss[1]:.3f})"
        )


if __name__ == "__main__":
    main()
