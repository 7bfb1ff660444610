"""Lesson 18: 1-bit Adam -- the momentum as signs, error feedback, and what crosses a slow link.

On a spawned 4-rank gloo world: the compressed mean (nanomega/onebit.py) of a momentum-shaped
vector, its bytes against the formula, its result against the exact mean; the running sums with
and without error feedback; then the alpha-beta time of one step's traffic on a capped link.
Run from the repository root: python lessons/18_one_bit_adam.py
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from check import check  # noqa: E402
from nanomega import dist, onebit, worlds  # noqa: E402

WORLD, N, STEPS = 4, 8 * 4 * 1000, 50  # ranks; momentum elements; steps of the running sum


def momentum(step, rank):
    """A momentum-shaped vector: a drift every rank shares plus this rank's noise."""
    g = torch.Generator().manual_seed(step * 100 + rank)
    drift = torch.linspace(-1, 1, N)
    return drift + 0.5 * torch.randn(N, generator=g)


def run(world):
    grid = dist.Grid(world, 1, 1)
    mean, forgetful = onebit.CompressedMean(grid.dp, N), onebit.CompressedMean(grid.dp, N)
    forgotten_sum = torch.zeros(N, dtype=torch.float64)
    exact_sum, compressed_sum = (
        torch.zeros(N, dtype=torch.float64),
        torch.zeros(N, dtype=torch.float64),
    )
    for step in range(STEPS):
        m = momentum(step, grid.dp.rank)
        exact = m.clone()
        grid.dp.all_reduce(exact)  # (the exact mean, for the comparison only: not counted below)
        exact_sum += exact.double() / world
        grid.log.reset()  # count one compressed mean's bytes
        compressed_sum += mean(m).double()
        wire = grid.log.wire_bytes("dp")
        forgotten_sum += forgetful(m).double()  # no error feedback: the errors dropped
        forgetful.worker_error.zero_()
        forgetful.server_error.zero_()
    # one compressed mean with no history: its error, for scale
    m = momentum(STEPS, grid.dp.rank)
    exact = grid.dp.all_reduce(m.clone()) / world
    fresh = onebit.CompressedMean(grid.dp, N)(m)
    return dict(
        wire=wire,
        gap=(compressed_sum - exact_sum).norm().item(),
        forgotten=(forgotten_sum - exact_sum).norm().item(),
        one_step=(fresh - exact).norm().item(),
        scale=exact.norm().item(),
    )


def main():
    r = worlds.launch(run, WORLD, WORLD)[0]
    print(f"{WORLD} ranks, {N:,} momentum elements, {STEPS} steps")

    # 1. bytes: signs and one scale per chunk, twice (all-to-all, all-gather) vs fp32's all-reduce
    fp32 = 2 * (WORLD - 1) / WORLD * 4 * N
    check("bytes per rank per compressed mean", r["wire"], onebit.wire_bytes(N, WORLD), unit=" B")
    check("fp32 all-reduce / 1-bit bytes", fp32 / r["wire"], 32.0, rtol=0.01)

    # 2. error feedback: the running sum of what was sent tracks the true running sum
    print(f"one step's compressed mean: |error| = {r['one_step']:.1f} (|mean| {r['scale']:.1f})")
    print(f"after {STEPS} steps: |sum sent - true sum| = {r['gap']:.1f} with error feedback,")
    print(
        f"                     {r['forgotten']:.1f} without (the same compressor, errors dropped)"
    )
    check(
        "with feedback the sum's error < 1/5 of without (1 = yes)",
        r["gap"] < r["forgotten"] / 5,
        True,
    )

    # 3. alpha-beta on a slow inter-host link: README's 1.33M-parameter model, 2 hosts (R = 2)
    params, rate, alpha = 1_330_000, 100e6 / 8, 100e-6  # bytes/s of a 100 Mbit/s link; latency
    plain = 2 * (2 - 1) / 2 * 4 * params
    compressed = onebit.wire_bytes(params, 2)
    for name, b, msgs in (("fp32 all-reduce", plain, 2), ("1-bit Adam", compressed, 4)):
        print(
            f"{name:>16}: {b / 1e6:7.3f} MB across, {msgs * alpha + b / rate:.4f} s at 100 Mbit/s"
        )
    saved = plain / rate - compressed / rate  # the alpha-beta model's, not a measurement
    check(
        "time saved at 100 Mbit/s > 0.3 s/step (1 = yes)",
        saved > 0.3,
        True,
        labels=("predicted", "wanted"),
    )
    print("(1-bit Adam's 4 collectives: signs and scales all-to-all, then all-gathered)")
    assert math.isfinite(r["gap"])


if __name__ == "__main__":
    main()
