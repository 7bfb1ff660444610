"""Pipeline parallelism: nanomega.pp against torch.distributed.pipelining (ScheduleGPipe,
Schedule1F1B).

Same dense GPT, same 2-stage split, same micro-batches, 2 CPU ranks with one thread each (p = 2: at
p = 4 the ranks would share 2 cores and the timings would lie). Measured per schedule:
  step time     median and minimum over --steps steps, the two implementations alternating step by step
                (the minimum is the least disturbed by other processes sharing the cores)
  peak memory   per stage, the rise of the kernel's peak RSS (VmHWM, reset through /proc/self/clear_refs)
                during one step, in a second world started with MALLOC_MMAP_THRESHOLD_=65536 so that every
                freed tensor goes back to the kernel, plus what lives between steps: torch keeps one receive
                buffer per micro-batch and direction, nanomega none; and the peak bytes autograd saved
                (recompute.ActivationMeter)
  bubble        ours, from the wall-clock trace, next to (p - 1) / (m + p - 1)
Usage: python bench/bench_pp.py [--microbatches 8] [--steps 5]
"""

import argparse
import copy
import os
import re
import statistics
import time

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from nanomega import dist, pp, recompute, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT, cross_entropy
from nanomega.schedules import Trace, bubble_fraction

CFG = dict(vocab_size=512, block_size=128, n_layer=8, n_head=4, n_embd=256)
MB, SEQ = 4, 128
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def rss_peak_rise(step):
    """Run step(); return how far the process's resident memory peaked above where it started
    (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    status = open("/proc/self/status").read()
    start = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    step()
    return (
        int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) - start
    ) * 1024


def _setup(grid, schedule, m):
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**CFG))
    ours = pp.build_stage(copy.deepcopy(dense), grid)
    theirs = pp.build_stage(copy.deepcopy(dense), grid)
    stage = PipelineStage(theirs, grid.pp_rank, grid.pp.size, grid.device, group=grid.pp.group)
    sched = TORCH_SCHEDULES[schedule](stage, n_microbatches=m, loss_fn=cross_entropy)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, CFG["vocab_size"], (m * MB, SEQ), generator=g) for _ in range(2))
    batches = list(zip(x.chunk(m), y.chunk(m)))

    def step_ours(trace=None):
        loss = pp.train_step(ours, grid, batches, schedule, trace=trace)
        pp.sync_tied_grads(ours, grid)
        return loss

    def step_theirs():
        losses = []
        if grid.first_stage:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        pp.sync_tied_grads(theirs, grid)
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        return grid.pp.broadcast(loss, src_index=grid.pp.size - 1).item()

    return (ours, step_ours), (theirs, step_theirs), stage


def persistent_recv_buffers(stage):
    """Bytes of the receive buffers torch.distributed.pipelining keeps between steps (private
    attributes)."""
    infos = [i for d in (stage.args_recv_info, stage.grad_recv_info) for t in d.values() for i in t]
    return sum(
        i.buffer.numel() * i.buffer.element_size()
        for i in infos
        if getattr(i, "buffer", None) is not None
    )


def timed(axis, fn):
    """Seconds fn takes on the slowest rank of `axis` (the ranks start together)."""
    axis.all_reduce(torch.zeros(1))
    t0 = time.perf_counter()
    fn()
    return axis.all_reduce(
        torch.tensor([time.perf_counter() - t0]), op=torch.distributed.ReduceOp.MAX
    ).item()


def time_world(m, steps):
    grid = dist.Grid(1, 2, 1)
    out = {}
    for schedule in TORCH_SCHEDULES:
        (ours, step_ours), (theirs, step_theirs), _ = _setup(grid, schedule, m)
        loss_ours, loss_theirs = step_ours(), step_theirs()  # warm-up (torch infers shapes here)
        times = {"ours": [], "torch": []}
        for _ in range(steps):
            times["ours"].append(timed(grid.pp, step_ours))
            times["torch"].append(timed(grid.pp, step_theirs))
        trace = Trace(grid.pp_rank)
        step_ours(trace)
        out[schedule] = dict(loss_ours=loss_ours, loss_torch=loss_theirs, trace=trace, times=times)
    return out


def memory_world(m):
    grid = dist.Grid(1, 2, 1)
    out = {}
    for schedule in TORCH_SCHEDULES:
        (ours, step_ours), (theirs, step_theirs), stage = _setup(grid, schedule, m)
        step_ours(), step_theirs()  # warm-up: gradients and torch's buffers exist from here on
        out[schedule] = {
            "rss_ours": rss_peak_rise(step_ours),
            "rss_torch": rss_peak_rise(step_theirs) + persistent_recv_buffers(stage),
        }
        for name, model, fn in (
            ("saved_ours", ours, step_ours),
            ("saved_torch", theirs, step_theirs),
        ):
            with recompute.ActivationMeter(model) as meter:
                fn()
            out[schedule][name] = meter.peak
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    m, p = args.microbatches, 2
    print(
        f"model {CFG}, micro-batch {MB}x{SEQ}, m={m}, p={p}, 1 thread per rank, torch {torch.__version__}, "
        f"load average before {os.getloadavg()[0]:.1f}"
    )
    timing = worlds.launch(time_world, p, m, args.steps, timeout=1200)
    # read by the spawned ranks' allocator at start-up
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    memory = worlds.launch(memory_world, p, m, timeout=1200)
    mib = 2**20
    print(
        f"load average after {os.getloadavg()[0]:.1f} (other processes on these 2 cores skew the times)"
    )
    for schedule in TORCH_SCHEDULES:
        t = timing[0][schedule]
        print(f"\n{schedule}: loss ours {t['loss_ours']:.6f}, torch {t['loss_torch']:.6f}")
        for stat in (statistics.median, min):
            ours, theirs = stat(t["times"]["ours"]), stat(t["times"]["torch"])
            print(
                f"  step time {stat.__name__:>6}   ours {ours * 1e3:7.1f} ms   torch {theirs * 1e3:7.1f} ms   "
                f"ratio ours/torch {ours / theirs:.3f}"
            )
        for rank in range(p):
            r = memory[rank][schedule]
            print(
                f"  stage {rank}: peak memory ours {r['rss_ours'] / mib:7.1f} MiB  torch {r['rss_torch'] / mib:7.1f}"
                f" MiB  ratio {r['rss_ours'] / r['rss_torch']:.3f}   saved activations ours "
                f"{r['saved_ours'] / mib:6.1f} MiB  torch {r['saved_torch'] / mib:6.1f} MiB"
            )
        traces = [timing[r][schedule]["trace"] for r in range(p)]
        print(
            f"  bubble (ours, wall clock) {bubble_fraction(traces):.3f}, formula (p-1)/(m+p-1) "
            f"{(p - 1) / (m + p - 1):.3f}"
        )


if __name__ == "__main__":
    main()
