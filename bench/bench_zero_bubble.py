"""Zero bubble: step time of 1F1B against ZB-H1, ZB-H2, ZB-V and DualPipeV at pp 4 on CPU ranks, next to
what the bubble formulas and the simulator predict from the measured op times.

Same dense GPT, the same 4-stage split (ZB-V: 8 chunks of one block in a V) and micro-batches; 4
gloo ranks, one thread each; the schedules alternate step by step (the minimum over --steps is the
least disturbed step). From each schedule's wall-clock trace: the mean op times t_f, t_b (1F1B: the
whole backward; the split schedules: B, the input gradient) and t_w, the bubble measured
(schedules.bubble_fraction), and the predicted step time
    1F1B   (m + p - 1)(t_f + t_bw)                              t_bw: 1F1B's whole backward
    ZB-H1  m (t_f + t_b + t_w) + (p - 1)(t_f + t_b - t_w)       (Qi et al. 2024, Table 1)
    ZB-H2  m (t_f + t_b + t_w) + (p - 1) max(t_f, t_f + t_b - 2 t_w)   (the step synchronized;
           lessons/05: the paper's (p - 1)(t_f + t_b - 2 t_w) is each rank's own span)
    ZB-V   no closed form at unequal times: the simulator's step at the measured chunk op times
    DualPipeV  the same (its pairs run F, B, W back to back on a CPU: nothing overlaps here)
and the simulator's step (schedules.simulate at the measured op times, in 0.1 ms) for each.
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
from nanomega.schedules import Trace, bubble_fraction, simulate

SPLIT = ("zb-h1", "zb-h2")  # on the loop, one chunk per rank
V = ("zb-v", "dualpipev")  # on the V, two chunks per rank (DualPipeV: m >= 2p)
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
        **{s: wgrad.split_backward(pp.build_stage(copy.deepcopy(dense), grid)) for s in SPLIT},
        **{s: wgrad.split_backward(pp.build_stage(copy.deepcopy(dense), grid, 2, "v")) for s in V},
    }
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, CFG["vocab_size"], (m * MB, SEQ), generator=g) for _ in range(2))
    batches = list(zip(x.chunk(m), y.chunk(m)))
    times, traces, losses = {s: [] for s in stages}, {}, {}
    for _ in range(steps + 1):  # the first step warms up
        for schedule, stage in stages.items():
            trace = Trace(grid.pp_rank)
            start = time.perf_counter()
            virtual = 2 if schedule in V else 1
            losses[schedule] = pp.train_step(stage, grid, batches, schedule, virtual=virtual,
                                             trace=trace)  # fmt: skip
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
    # the same loss every way (ZB-V's tied matrix sums in another order: within rounding)
    losses = [ranks[0]["losses"][s] for s in times]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), losses
    t_f = statistics.mean(_mean(t, "F") for t in traces["1f1b"])
    t_bw = statistics.mean(_mean(t, "B") for t in traces["1f1b"])
    op = {s: [statistics.mean(_mean(t, k) for t in traces[s]) for k in "FBW"] for s in times}
    a, b, c = op["zb-h1"]
    a2, b2, c2 = op["zb-h2"]
    predicted = {
        "1f1b": (m + p - 1) * (t_f + t_bw),
        "zb-h1": m * (a + b + c) + (p - 1) * (a + b - c),
        "zb-h2": m * (a2 + b2 + c2) + (p - 1) * max(a2, a2 + b2 - 2 * c2),
    }
    simulated = {}
    for s, (f, bk, w) in op.items():
        f, bk, w = (round(x * 1e4) for x in (f, bk if s != "1f1b" else t_bw, w))
        v = 2 if s in V else 1
        sim = simulate(p, m, s, v=v, t_f=f, t_b=bk, t_w=w)
        simulated[s] = max(e.end for t in sim for e in t.events) / 1e4
    print(f"p={p} m={m} x ({MB} x {SEQ}) tokens, {CFG}; mean op times (ms), F B W: "
          + "; ".join(f"{s} " + " ".join(f"{x * 1e3:.1f}" for x in op[s]) for s in op))  # fmt: skip
    print("| schedule | step time min (median) | formula | simulator | bubble measured |")
    print("| --- | --- | --- | --- | --- |")
    for s in times:
        formula = f"{predicted[s] * 1e3:.0f} ms" if s in predicted else "-"
        print(
            f"| {s} | {min(times[s]) * 1e3:.0f} ({statistics.median(times[s]) * 1e3:.0f}) ms | "
            f"{formula} | {simulated[s] * 1e3:.0f} ms | {bubble_fraction(traces[s]):.3f} |"
        )
    for s in list(times)[1:]:
        print(f"{s} / 1F1B minimum step time: {min(times[s]) / min(times['1f1b']):.3f} measured, "
              f"{simulated[s] / simulated['1f1b']:.3f} simulated")  # fmt: skip


if __name__ == "__main__":
    main()
