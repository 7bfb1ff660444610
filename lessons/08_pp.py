"""Lesson 08: pipeline parallelism. The bubble on a unit clock (exact), then a real 4-stage CPU run:
wall-clock timelines of GPipe and 1F1B, and the activation memory each schedule holds per stage."""

import torch

from check import check
from nanomega import dist, pp, recompute, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.schedules import Trace, bubble_fraction, peak_inflight, simulate
from nanomega.timeline import draw_timeline

P, M, V = 4, 8, 2
# 2 blocks per stage
CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=256)
MB, SEQ = 4, 64


def stage_run(m):
    """This rank's stage: one warm-up step, then GPipe and 1F1B steps with wall-clock traces and the
    memory they held (saved activations, and sent outputs with and without the deallocate trick)."""
    grid = dist.Grid(1, P, 1)
    torch.manual_seed(0)
    model = pp.build_stage(GPT(CFG), grid)
    g = torch.Generator().manual_seed(0)
    batches = [
        tuple(torch.randint(0, CFG.vocab_size, (MB, SEQ), generator=g) for _ in range(2))
        for _ in range(m)
    ]
    pp.train_step(model, grid, batches, "1f1b")  # warm-up
    out = {}
    for schedule, mm, deallocate in (
        ("gpipe", m, True),
        ("1f1b", m, True),
        ("gpipe", 1, True),
        ("1f1b", m, False),
    ):
        trace = Trace(grid.pp_rank)
        with recompute.ActivationMeter(model) as meter:
            loss = pp.train_step(
                model, grid, batches[:mm], schedule, trace=trace, deallocate=deallocate
            )
        out[(schedule, mm, deallocate)] = dict(trace=trace, saved=meter.peak, loss=loss)
    return out


if __name__ == "__main__":
    print(f"--- unit clock: F = 1, B = 2, p = {P}, m = {M} ---")
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", V)):
        traces = simulate(P, M, schedule, v)
        print(f"{schedule}" + (f" (v = {v} chunks per rank)" if v > 1 else "") + ":")
        print(draw_timeline(traces))
        idle = bubble_fraction(traces)
        check(f"{schedule} bubble, unit clock", idle, (P - 1) / (v * M + P - 1), rtol=1e-9)
        # Narayanan et al. quote the bubble against the ideal time m (F + B) instead: (p-1)/(v m)
        # extra time
        check(
            f"{schedule} bubble as extra time over the ideal, (p-1)/(v m)",
            idle / (1 - idle),
            (P - 1) / (v * M),
            rtol=1e-9,
        )

    # zero bubble (Qi et al. 2024): the backward split into B (input gradient) and W (weights)
    print(f"\n--- zero bubble, unit clock: F = B = W = 1, p = {P}, m = {M} (paper, Table 1) ---")
    t = 1  # T_F = T_B = T_W
    for schedule, kw, idle, peak in (
        ("1f1b", dict(t_b=2 * t), (P - 1) * 3 * t, P),  # B and W as one backward
        ("zb-h1", dict(t_b=t, t_w=t), (P - 1) * t, P),
    ):
        traces = simulate(P, M, schedule, t_f=t, **kw)
        if schedule == "zb-h1":
            print(draw_timeline(traces))
        span = max(e.end for tr in traces for e in tr.events)
        worst = max(span - sum(e.end - e.start for e in tr.events) for tr in traces)
        check(f"{schedule} idle per rank, unit clock", worst, idle, labels=("simulated", "paper"))
        check(
            f"{schedule} peak micro-batches held", max(map(peak_inflight, traces)), peak,
            labels=("simulated", "paper"),
        )  # fmt: skip

    # the paper's Table 1 at unequal times too; ZB-H2's bubble is each rank's own span (the
    # optimizer step's synchronization bypassed), the synchronized step adds the ranks' offsets
    print(f"\n--- Qi et al. 2024, Table 1, simulated: p = {P}, m = {M} ---")
    print("schedule  T_F T_B T_W  bubble (paper)            simulated  memory (paper)  simulated")
    for t_f, t_b, t_w in ((1, 1, 1), (3, 2, 2), (2, 3, 1)):
        for schedule, bubble, peak in (
            ("1f1b", (P - 1) * (t_f + t_b + t_w), P),
            ("zb-h1", (P - 1) * (t_f + t_b - t_w), P),
            ("zb-h2", (P - 1) * (t_f + t_b - 2 * t_w), 2 * P - 1),
        ):
            kw = dict(t_b=t_b + t_w) if schedule == "1f1b" else dict(t_b=t_b, t_w=t_w)
            traces = simulate(P, M, schedule, t_f=t_f, **kw)
            if schedule == "zb-h2":  # idle from each rank's own first op to its own last
                idle = max(
                    max(e.end for e in tr.events) - min(e.start for e in tr.events)
                    - sum(e.end - e.start for e in tr.events) for tr in traces
                )  # fmt: skip
            else:
                span = max(e.end for tr in traces for e in tr.events)
                idle = max(span - sum(e.end - e.start for e in tr.events) for tr in traces)
            held = max(map(peak_inflight, traces))
            print(f"{schedule:9} {t_f:3} {t_b:3} {t_w:3}  {bubble:<25} {idle:<10} "
                  f"{peak:<15} {held}")  # fmt: skip
            check(f"{schedule} ({t_f}, {t_b}, {t_w}) bubble", idle, bubble,
                  labels=("simulated", "paper"))  # fmt: skip
            check(f"{schedule} ({t_f}, {t_b}, {t_w}) memory", held, peak,
                  labels=("simulated", "paper"))  # fmt: skip
    traces = simulate(P, M, "zb-h2", t_f=1, t_b=1, t_w=1)
    print("zb-h2 at T = 1, the parallelogram (rank r starts r T_F late and ends r T_F late):")
    print(draw_timeline(traces))
    span = max(e.end for tr in traces for e in tr.events)
    check("zb-h2 synchronized step, unit clock", span, 3 * M + P - 1,
          labels=("simulated", "m (T_F + T_B + T_W) + (p - 1) T_F"))  # fmt: skip
    traces = simulate(P, M, "zb-v", v=2, t_f=1, t_b=1, t_w=1)
    print("zb-v at T = 1 per chunk (half a stage), p = 4, m = 8:")
    print(draw_timeline(traces))
    span = max(e.end for tr in traces for e in tr.events)
    check("zb-v idle per rank, unit clock (chunk ops)", span - 6 * M, P - 1,
          labels=("simulated", "(p - 1), ours"))  # fmt: skip

    print(
        f"\n--- real run: 4 gloo ranks on this CPU, {CFG.n_layer} blocks h={CFG.n_embd}, micro-batch {MB}x{SEQ} ---"
    )
    results = worlds.launch(stage_run, P, M, timeout=600)
    act = MB * SEQ * CFG.n_embd * 4  # one stage output (mb, s, h) in fp32
    for schedule in ("gpipe", "1f1b"):
        runs = [r[(schedule, M, True)] for r in results]
        print(f"{schedule}, wall clock (loss {runs[0]['loss']:.4f}):")
        print(draw_timeline([run["trace"] for run in runs], width=110))
        idle = bubble_fraction([run["trace"] for run in runs])
        print(
            f"{schedule}: measured bubble {idle:.3f} of the step (formula (p-1)/(m+p-1) {(P - 1) / (M + P - 1):.3f}), "
            f"{idle / (1 - idle):.3f} extra over the ideal (formula (p-1)/m {(P - 1) / M:.3f})"
        )
    print(
        "\n--- activation memory per stage: bytes autograd saved (ActivationMeter), peak over the step ---"
    )
    for rank, r in enumerate(results):
        one = r[("gpipe", 1, True)]["saved"]  # one micro-batch's saved activations on this stage
        check(
            f"stage {rank} gpipe peak saved = m x one micro-batch",
            r[("gpipe", M, True)]["saved"],
            M * one,
            unit=" B",
        )
        check(
            f"stage {rank} 1f1b peak saved = min(m, p - rank) x one micro-batch",
            r[("1f1b", M, True)]["saved"],
            min(M, P - rank) * one,
            unit=" B",
        )
    print("\n--- sent stage outputs still held (1F1B): the deallocate trick ---")
    for rank, r in enumerate(results):
        check(
            f"stage {rank} held outputs, deallocated",
            r[("1f1b", M, True)]["trace"].peak_output_bytes,
            0,
            unit=" B",
        )
        check(
            f"stage {rank} held outputs, kept",
            r[("1f1b", M, False)]["trace"].peak_output_bytes,
            0 if rank == P - 1 else (P - rank) * act,
            unit=" B",
        )
