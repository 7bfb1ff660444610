"""Lesson 22: sizing a run -- how many parameters and tokens a compute budget buys (Chinchilla), and
the published recipes for batch size, learning rate and warm-up. Nothing here is measured: formulas
against published tables.
Run from the repository root: python lessons/22_sizing.py
"""

import math
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from check import check  # noqa: E402
from nanomega import formulas as F  # noqa: E402
from nanomega.tools import cost as C  # noqa: E402

# Chinchilla (Hoffmann et al. 2022), Table 3: the compute-optimal parameters for a budget of
# FLOPs (approach 1)
TABLE3 = [
    (400e6, 1.92e19, 8.0e9),
    (1e9, 1.21e20, 20.2e9),
    (10e9, 1.23e22, 205.1e9),
    (67e9, 5.76e23, 1.5e12),
    # N, FLOPs, tokens
    (175e9, 3.85e24, 3.7e12),
    (280e9, 9.90e24, 5.9e12),
    (1e12, 1.27e26, 21.2e12),
]
# what published runs chose
RUNS = [
    ("GPT-3 175B (Brown et al. 2020)", 174.6e9, 300e9),
    ("Chinchilla 70B (Hoffmann et al. 2022)", 70e9, 1.4e12),
    ("BLOOM 176B (BigScience 2022)", 176e9, 366e9),
    ("Llama 3 8B (Grattafiori et al. 2024)", 8e9, 15e12),
    ("Llama 3 405B", 405e9, 15.6e12),
]
# GPT-3 (Brown et al. 2020), Table 2.1: batch in tokens and peak learning rate by size
GPT3 = [
    ("125M", 0.5e6, 6.0e-4),
    ("350M", 0.5e6, 3.0e-4),
    ("760M", 0.5e6, 2.5e-4),
    ("1.3B", 1e6, 2.0e-4),
    ("2.7B", 1e6, 1.6e-4),
    ("6.7B", 2e6, 1.2e-4),
    ("13B", 2e6, 1.0e-4),
    ("175B", 3.2e6, 0.6e-4),
]


def main():
    # 1. Chinchilla's Table 3 against k = 20 tokens per parameter
    print(
        "== Compute-optimal N for a budget C: N = sqrt(C / 6k), D = k N, k = 20 tokens per parameter"
    )
    for n, flops, tokens in TABLE3:
        got, d = F.chinchilla_optimal(flops)
        print(
            f"  C = {flops:.3g}: N = {got / 1e9:7.1f}B, D = {d / 1e9:8.0f}B "
            f"(Table 3: {n / 1e9:g}B on {tokens / 1e9:g}B tokens, {tokens / n:.1f} tokens per parameter)"
        )
        check(
            f"Chinchilla Table 3, {n / 1e9:g}B row: N for C = {flops:.3g}",
            got / 1e9,
            n / 1e9,
            rtol=0.05,
            unit="B",
            labels=("sqrt(C/120)", "Table 3"),
        )

    # 2. what published runs chose, in tokens per parameter
    print("== Tokens per parameter of published runs")
    for name, n, d in RUNS:
        print(f"  {name:<38} {d / n:8.1f} tokens per parameter; 6ND = {6 * n * d:.2g} FLOPs")
    n405, d405 = F.chinchilla_optimal(3.8e25)
    print(
        f"  Llama 3's budget 3.8e25 at k = 20: N = {n405 / 1e9:.0f}B on {d405 / 1e12:.1f}T tokens; their own scaling "
        f"law said 402B on 16.55T (k = 41): the 20 is a fit to Chinchilla's data, not a constant of nature"
    )

    # 3. the published recipes: GPT-3 Table 2.1 -- larger models, larger batches, smaller learning rates
    print("== GPT-3 (Brown et al. 2020, Table 2.1): batch in tokens and peak learning rate by size")
    for size, batch, lr in GPT3:
        print(
            f"  {size:>5}: batch {batch / 1e6:3.1f}M tokens ({batch / 2048:5.0f} sequences of 2048), lr {lr:.1e}"
        )

    # the 175B run's warm-up (375M tokens) happens inside its batch ramp (32k -> 3.2M tokens, linear in the tokens
    # seen, over the first 4-12B tokens: App. B): a batch b(T) = b0 + (b1 - b0) T / R tokens at T tokens, so the
    # steps over the first W tokens are the integral of dT / b(T) = R / (b1 - b0) ln(b(W) / b0)
    b0, b1, warm = 32e3, 3.2e6, 375e6
    steps = {
        ramp: ramp / (b1 - b0) * math.log((b0 + (b1 - b0) * warm / ramp) / b0)
        for ramp in (4e9, 12e9)
    }
    print(
        f"  175B: warm-up 375M tokens, inside the batch ramp from 32k tokens over the first 4-12B tokens: "
        f"{steps[4e9]:,.0f} steps (ramp over 4B) to {steps[12e9]:,.0f} (over 12B), not {warm / b1:.0f} steps of "
        f"3.2M; cosine decay to 10% of the peak over 260B tokens"
    )

    # 4. what the budget costs on a cluster: the planner on a compute-optimal 70B (the llama3-70b preset
    # at s = 2048)
    print(
        "== The planner: a 70B model (llama3-70b's shape, s = 2048) on 1.4T tokens, 1024 A100-80GB, batch 1536 x 2048"
    )
    from nanomega.tools import layouts, plan as P  # noqa: E402

    model = replace(C.MODELS["llama3-70b"], seq_len=2048)
    best = layouts.plan(model, C.GPUS["a100-80gb"], 1024, C.Run(global_batch=1536, tokens=1.4e12))[
        0
    ]
    print(
        f"  {P.describe(best)}: step {best.step_s:.1f} s, MFU {best.mfu:.1%}, {best.days:.0f} days for 6ND = "
        f"{6 * 70e9 * 1.4e12:.2g} FLOPs (Chinchilla's batch: 1.5M tokens, doubled to 3M during training)"
    )


if __name__ == "__main__":
    main()
