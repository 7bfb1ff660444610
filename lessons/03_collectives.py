"""Lesson 03: the collectives, what each moves, and the alpha-beta model -- on a spawned 4-rank gloo
world.

Every byte goes through nanomega.dist.Axis, whose CommLog counts it. The five collectives are
checked for their results; a ring all-reduce and an all-to-all built from point-to-point sends are
checked for their results AND for the bytes they sent against the ring formulas. Run from the
repository root: python lessons/03_collectives.py
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from check import check  # noqa: E402
from nanomega import dist, formulas, worlds  # noqa: E402

WORLD, ELEMS = 4, 4096  # ranks; fp32 elements per rank (B = 16 KiB), divisible by WORLD


def ring_all_reduce(ax, x):
    """Sum x over the axis in 2(n-1) steps: reduce-scatter (each step: send one chunk right, add the
    chunk from the left) then all-gather (pass the finished chunks around). Every rank sends 2(n-1)
    chunks of B/n."""
    n, r = ax.size, ax.rank
    chunks, buf = list(x.chunk(n)), torch.empty(x.numel() // n)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):  # after this, rank r holds the full sum of chunk (r + 1) % n
        ax.p2p(sends=[(chunks[(r - step) % n].clone(), right)], recvs=[(buf, left)])
        chunks[(r - step - 1) % n] += buf
    for step in range(n - 1):
        ax.p2p(sends=[(chunks[(r + 1 - step) % n].clone(), right)], recvs=[(buf, left)])
        chunks[(r - step) % n].copy_(buf)
    return x


def all_to_all(ax, x):
    """Chunk j of every rank goes to rank j (the expert-parallel shuffle): each rank sends n-1
    chunks of B/n."""
    n, r = ax.size, ax.rank
    chunks, out = list(x.chunk(n)), [torch.empty(x.numel() // n) for _ in range(n)]
    out[r].copy_(chunks[r])
    ax.p2p(
        sends=[(chunks[j].clone(), j) for j in range(n) if j != r],
        recvs=[(out[j], j) for j in range(n) if j != r],
    )
    return torch.cat(out)


def experiment():
    # one axis over the whole world; Axis and its CommLog count every byte
    grid = dist.Grid(dp=WORLD)
    ax, r, n, log = grid.dp, grid.rank, WORLD, grid.log
    res, sent = {}, {}
    x = torch.full((ELEMS,), float(r + 1))
    res["all_reduce"] = bool((ax.all_reduce(x) == n * (n + 1) / 2).all())  # sum of 1..n everywhere
    out = torch.empty(n * ELEMS)
    ax.all_gather(out, torch.full((ELEMS,), float(r)))
    # rank j's block j
    res["all_gather"] = bool((out == torch.arange(n).float().repeat_interleave(ELEMS)).all())
    part = torch.empty(ELEMS // n)
    ax.reduce_scatter(part, torch.arange(ELEMS).float())  # n copies of arange, summed, block r kept
    res["reduce_scatter"] = bool(
        (part == n * torch.arange(r * ELEMS // n, (r + 1) * ELEMS // n).float()).all()
    )
    y = torch.full((ELEMS,), float(r))
    res["broadcast"] = bool((ax.broadcast(y, 0) == 0).all())
    # built from point-to-point sends, counted as sends: the bytes really sent
    log.reset()
    # integers: exact
    z = torch.randint(-1000, 1000, (ELEMS,), generator=torch.Generator().manual_seed(r)).float()
    want = ax.all_reduce(z.clone())
    log.reset()
    res["ring_all_reduce"] = bool(torch.equal(ring_all_reduce(ax, z), want))
    sent["ring_all_reduce"] = log.bytes("send")
    log.reset()
    a2a = all_to_all(ax, (100 * r + torch.arange(n).float()).repeat_interleave(ELEMS // n))
    res["all_to_all"] = bool(
        (a2a == (100 * torch.arange(n).float() + r).repeat_interleave(ELEMS // n)).all()
    )
    sent["all_to_all"] = log.bytes("send")
    # the alpha-beta model on this machine: time gloo's all-reduce at several sizes (printed, not
    # checked)
    times = {}
    for elems in (256, 16384, 262144, 4194304):  # 1 KiB to 16 MiB
        t, best = torch.ones(elems), float("inf")
        for _ in range(5):  # the fastest of 5: other processes on shared cores only ever add time
            ax.barrier()
            start = time.perf_counter()
            ax.all_reduce(t)
            best = min(best, time.perf_counter() - start)
        times[elems * 4] = best
    return res, sent, times


if __name__ == "__main__":
    results = worlds.launch(experiment, WORLD)
    res, sent, times = results[0]
    for op in (
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "ring_all_reduce",
        "all_to_all",
    ):
        check(f"{op} result on every rank (1 = right)", int(all(rr[0][op] for rr in results)), 1)
    B = ELEMS * 4
    for r, (_, s, _) in enumerate(results):
        check(
            f"rank {r}: ring all-reduce sent 2(n-1)/n x B",
            s["ring_all_reduce"],
            2 * (WORLD - 1) / WORLD * B,
            unit=" B",
        )
    check(
        "rank 0: all-to-all sent (n-1)/n x B",
        sent["all_to_all"],
        (WORLD - 1) / WORLD * B,
        unit=" B",
    )
    check(
        "dist.RING's all-reduce factor = the hand ring's",
        dist.RING["all_reduce"](WORLD) * B,
        sent["ring_all_reduce"],
        labels=("dist.RING", "hand ring"),
    )
    # fit T = a + b S over the sizes: for a ring all-reduce a = 2(n-1) alpha, b = 2(n-1)/n beta
    xs, ys = list(times), list(times.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((u - mx) * (v - my) for u, v in zip(xs, ys)) / sum((u - mx) ** 2 for u in xs)
    a = my - b * mx
    alpha, beta = a / (2 * (WORLD - 1)), b / (2 * (WORLD - 1) / WORLD)
    print("gloo all-reduce, 4 ranks on this machine's cores (timings: label them with your CPU):")
    for size, t in times.items():
        fit = formulas.collective_seconds("all_reduce", WORLD, size, alpha, beta)
        print(f"  {size:>9,} B: {t * 1e6:8.0f} us; alpha-beta fit {fit * 1e6:8.0f} us")
    print(
        f"  fit: alpha = {alpha * 1e6:.0f} us per step, 1/beta = {1 / beta / 1e9:.2f} GB/s per link"
        if beta > 0
        else "  fit: no bandwidth term visible (noise from other processes on the cores dominates)"
    )
    # ring vs tree on a GPU cluster's numbers (alpha 5 us, 25 GB/s per link across nodes): where
    # they cross
    for n, size in ((64, 1e3), (64, 1e6), (64, 1e9)):
        ring = formulas.collective_seconds("all_reduce", n, size, 5e-6, 1 / 25e9)
        tree = formulas.collective_seconds("all_reduce", n, size, 5e-6, 1 / 25e9, "tree")
        print(
            f"  model, n = {n}, {size:>13,.0f} B: ring {ring * 1e3:9.3f} ms, tree {tree * 1e3:9.3f} ms -> "
            f"{'ring' if ring < tree else 'tree'}"
        )
