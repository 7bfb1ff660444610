"""Zero bubble: step time of 1F1B against ZB-H1 at pp 4 on CPU ranks, next to what the bubble
formulas predict from the measured op times.

Same dense GPT, the same 4-stage split and micro-batches; 4 gloo ranks, one thread each; the two
schedules alternate step by step (the minimum over --steps is the least disturbed step). From each
schedule's wall-clock trace: the mean op times t_f, t_b (1F1B: the whole backward; ZB-H1: B, the
input gradient) and t_w, the bubble measured (schedules.bubble_fraction), and the predicted step
time
    1F1B   (m + p - 1)(t_f + t_bw)                        t_bw: 1F1B's whole backward
    ZB-H1  m (t_f + t_b + t_w) + (p - 1)(t_f + t_b - t_w) (Qi et al. 2024, Table 1)
On a machine with fewer cores than ranks the ranks share cores: one rank's idle time is another's
compute time, and the measured gain is not the formulas' (they assume a core per stage).
Usage: python bench/bench_zero_bubble.py [--microbatches 8] [--steps 5]
"""

import argparse
import copy
import statistics
import time

import torch

from nanomega import dist, pp, wgrad, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.schedules import Trace, bubble_fraction

CFG = dict(vocab_size=512, block_size=128, n_layer=8, n_head=4, n_embd=256)
MB, SEQ = 4, 128


def _mean(trace, kind):
    spans = [e.end - e.start for e in trace.events if e.op == kind]
    return sum(spans) / len(spans) if spans else 0.0


def _bench(m, steps):
    torch.set_num_threads(1)
    grid = dist.Grid(1, 4, 1)
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**CFG))
    stages = {
        "1f1b": pp.build_stage(copy.deepcopy(dense), grid),
        "zb-h1": wgrad.split_backward(pp.build_stage(copy.deepcopy(dense), grid)),
    }
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, CFG["vocab_size"], (m * MB, SEQ), generator=g) for _ in range(2))
    batches = list(zip(x.chunk(m), y.chunk(m)))
    times, traces, losses = {s: [] for s in stages}, {}, {}
    for _ in range(steps + 1):  # the first step warms up
        for schedule, stage in stages.items():
            trace = Trace(grid.pp_rank)
            start = time.perf_counter()
            losses[schedule] = pp.train_step(stage, grid, batches, schedule, trace=trace)
            times[schedule].append(time.perf_counter() - start)
            traces[schedule] = trace
            stage.zero_grad(set_to_none=True)
    return dict(
        times={s: t[1:] for s, t in times.items()},
        traces=traces,
        losses=losses,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    m, p = args.microbatches, 4
    ranks = worlds.launch(_bench, 4, m, args.steps, timeout=1800)
    times = {
        s: [max(r["times"][s][i] for r in ranks) for i in range(args.steps)]
        for s in ranks[0]["times"]
    }
    traces = {s: [r["traces"][s] for r in ranks] for s in times}
    assert ranks[-1]["losses"]["1f1b"] == ranks[-1]["losses"]["zb-h1"]
    t_f = statistics.mean(_mean(t, "F") for t in traces["1f1b"])
    t_bw = statistics.mean(_mean(t, "B") for t in traces["1f1b"])
    t_b = statistics.mean(_mean(t, "B") for t in traces["zb-h1"])
    t_w = statistics.mean(_mean(t, "W") for t in traces["zb-h1"])
    predicted = {
        "1f1b": (m + p - 1) * (t_f + t_bw),
        "zb-h1": m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w),
    }
    formula = {
        "1f1b": (p - 1) / (m + p - 1),
        "zb-h1": (p - 1) * (t_f + t_b - t_w) / predicted["zb-h1"],
    }
    print(f"p={p} m={m} x ({MB} x {SEQ}) tokens, {CFG}; mean op times (ms): F {t_f * 1e3:.1f}, "
          f"1F1B's backward {t_bw * 1e3:.1f}, ZB-H1's B {t_b * 1e3:.1f}, "
          f"W {t_w * 1e3:.1f}")  # fmt: skip
    print("| schedule | step time min (median) | predicted | bubble measured (formula) |")
    print("| --- | --- | --- | --- |")
    for s in times:
        bubble = bubble_fraction(traces[s])
        print(
            f"| {s} | {min(times[s]) * 1e3:.0f} ({statistics.median(times[s]) * 1e3:.0f}) ms | "
            f"{predicted[s] * 1e3:.0f} ms | {bubble:.3f} ({formula[s]:.3f}) |"
        )
    ratio = min(times["zb-h1"]) / min(times["1f1b"])
    print(f"ZB-H1 / 1F1B step time: {ratio:.3f} measured, "
          f"{predicted['zb-h1'] / predicted['1f1b']:.3f} predicted")  # fmt: skip


if __name__ == "__main__":
    main()
