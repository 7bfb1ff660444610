"""Health check before a long run: find the slow or wrong rank before it costs a week (BLOOM,
DLRover).

One bad device slows (or silently corrupts) a whole synchronous job, so every rank is checked first:
its compute (a timed matmul against the median), its correctness (an exact known computation) and
its links (an all-reduce per grid axis; between hosts, DLRover's pairing: find_bad_hosts). A table
on the last rank, and a non-zero exit naming the bad rank or host.

    torchrun --nproc_per_node=2 -m nanomega.job.health      # alone
    torchrun ... nanomega/train.py --health-check ...        # before training

Formula: bus bandwidth = 2(n-1)/n x bytes / seconds (the ring's traffic).
Lessons: lessons/19-checkpoints-and-failures.md, lessons/20-when-training-breaks.md
"""

import argparse
import socket
import statistics
import sys
import time

import torch
import torch.distributed as tdist

from nanomega import dist

REPS = 5


def sizes(device):
    """(n, bytes): the matmul's side and the all-reduce's size. On a CPU 256 and 1 MiB take
    milliseconds; on a GPU they would time the launch (a 256^3 matmul is ~0.03 us of an H100's
    peak), so there 8192 (~1 ms) and 256 MiB (a bandwidth-bound all-reduce)."""
    return (8192, 256 << 20) if torch.device(device).type == "cuda" else (256, 1 << 20)


def synchronize(device):
    """Wait for the device's queued kernels: a CUDA call returns at launch, so an untimed
    wait is not a time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(slow=False, device=torch.device("cpu")):
    """FLOP/s of an n x n fp32 matmul on `device` (best of REPS)."""
    n = sizes(device)[0]
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    # on a GPU one more: the first call pays the kernel's set-up
    for _ in range(REPS + (device.type == "cuda")):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        dt = time.perf_counter() - t0
        if slow:  # a rank at a quarter of the rate: well below --slow-factor 0.5 x the median
            time.sleep(3 * dt)
            dt *= 4
        best = min(best, dt)
    return 2 * n**3 / best


def known_checksum(device=torch.device("cpu")):
    """An exact result: integer entries in [-8, 8), so every product and partial sum is an exact
    float64 -- in any BLAS, on the device under test (drawn on the host: the same inputs
    everywhere)."""
    g, n = torch.Generator().manual_seed(1234), min(sizes(device)[0], 2048)  # fp64: exact sums
    a = torch.randint(-8, 8, (n, n), generator=g, dtype=torch.float64).to(device)
    b = torch.randint(-8, 8, (n, n), generator=g, dtype=torch.float64).to(device)
    return float((a @ b).sum())


def bus_bandwidth(axis, device=torch.device("cpu")):
    """Bytes/s of the ring all-reduce on one grid axis (best of REPS), or None on a one-rank
    axis."""
    if axis.size < 2:
        return None
    size = sizes(device)[1]
    t = torch.ones(size // 4, device=device)  # on the device: NCCL has no CPU tensors
    best = float("inf")
    for _ in range(REPS):
        axis.barrier()
        synchronize(t.device)
        t0 = time.perf_counter()
        axis.all_reduce(t)
        synchronize(t.device)
        best = min(best, time.perf_counter() - t0)
    # the ring's traffic, as dist.py counts it
    return dist.RING["all_reduce"](axis.size) * size / best


def find_bad_hosts(hosts, pair_time, slow=2.0):
    """DLRover's bisection. Round 1 pairs neighbours (an odd one out pairs with the first host) and
    times each pair; a pair slower than `slow` x the median pair (the lower median: of two pairs the
    faster, as one of two can never be 2x their mean) is suspect. Round 2 pairs each suspect with a
    host from a fast pair: a suspect slow again is bad. Returns (bad hosts, pair times); with no
    fast pair, none can be told apart and every suspect is returned. pair_time(a, b) must run in the
    same order on every rank."""
    pairs = [(hosts[i], hosts[i + 1]) for i in range(0, len(hosts) - 1, 2)]
    if len(hosts) % 2 and len(hosts) > 1:
        pairs.append((hosts[-1], hosts[0]))
    times = {p: pair_time(*p) for p in pairs}
    if not times:
        return [], times

    median = statistics.median_low(times.values())
    slow_pairs = [p for p, t in times.items() if t > slow * median]
    suspects = sorted({h for p in slow_pairs for h in p})
    fast = [h for p in pairs if p not in slow_pairs for h in p if h not in suspects]
    if not fast:
        return suspects, times

    # round 2: each suspect with a host from a fast pair
    again = {h: pair_time(h, fast[i % len(fast)]) for i, h in enumerate(suspects)}
    times.update({(h, fast[i % len(fast)]): t for i, (h, t) in enumerate(again.items())})
    return [h for h, t in again.items() if t > slow * median], times


def pair_timer(grid, leaders, slow_rank=None):
    """pair_time(a, b) for find_bad_hosts: all-reduce seconds between two hosts' first ranks (best
    of REPS), shared with every rank by a world all-reduce (grid.all). Every rank calls it
    (grid.axis is collective)."""

    def pair_time(a, b):
        ranks = sorted({leaders[a], leaders[b]})
        pair = grid.axis("pair", ranks)  # None on the ranks outside the pair
        t = torch.zeros(1, device=grid.device)
        if pair is not None:
            buf, best = torch.ones(sizes(grid.device)[1] // 4, device=grid.device), float("inf")
            for _ in range(REPS):
                synchronize(buf.device)
                t0 = time.perf_counter()
                pair.all_reduce(buf)
                synchronize(buf.device)
                if slow_rank in ranks:  # testing: a slow link
                    time.sleep(3 * (time.perf_counter() - t0))
                best = min(best, time.perf_counter() - t0)
            t[0] = best if pair.rank == 0 else 0.0
        grid.all.all_reduce(t)
        return float(t)

    return pair_time


def check(grid, slow_rank=None, slow_factor=0.5, ranks_as_hosts=False):
    """Every rank: measure, gather, judge. Returns (table lines, [problems]) -- the
    same on every rank."""
    host = f"rank{grid.rank}" if ranks_as_hosts else socket.gethostname()
    mine = dict(
        host=host,
        rate=matmul_rate(grid.rank == slow_rank, grid.device),
        sum=known_checksum(grid.device),
    )
    everyone = grid.all.all_gather_object(mine)
    links = {a.name: bus_bandwidth(a, grid.device) for a in (grid.tp, grid.pp, grid.dp)}

    # judge: each rank's rate against the median, its checksum against the most common
    median = statistics.median(r["rate"] for r in everyone)
    expect = statistics.mode(r["sum"] for r in everyone)
    problems, lines = (
        [],
        [f"{'rank':>4} {'host':<16} {'GFLOP/s':>8} {'vs median':>9} {'checksum':>9}"],
    )
    for r, e in enumerate(everyone):
        slow, wrong = e["rate"] < slow_factor * median, e["sum"] != expect
        lines.append(
            f"{r:>4} {e['host'][:16]:<16} {e['rate'] / 1e9:8.2f} {e['rate'] / median:9.2f} "
            f"{'ok' if not wrong else 'WRONG':>9}" + ("  SLOW" if slow else "")
        )
        if slow:
            problems.append(
                f"rank {r} ({e['host']}) computes at {e['rate'] / median:.2f}x the median"
            )
        if wrong:
            problems.append(f"rank {r} ({e['host']}) got a wrong result for a known computation")

    for name, bw in links.items():
        lines.append(
            f"all-reduce on {name}: "
            + (
                f"{bw / 1e9:.2f} GB/s bus bandwidth (this rank's group)"
                if bw
                else "one rank, nothing to measure"
            )
        )

    # hosts: one rank per host, then the pairwise bisection
    leaders = {}
    for r, e in enumerate(everyone):
        leaders.setdefault(e["host"], r)
    bad, times = find_bad_hosts(sorted(leaders), pair_timer(grid, leaders, slow_rank))
    lines += [
        f"host pair {a} - {b}: {sizes(grid.device)[1] / t / 1e9:.2f} GB/s all-reduce"
        for (a, b), t in times.items()
    ]
    lines.append(
        f"hosts: {len(leaders)}"
        + ("; one pair: a slow link cannot be pinned on either host" if len(leaders) == 2 else "")
    )
    problems += [f"host {h} is slow in two host pairings" for h in bad]
    return lines, problems


def gate(grid, slow_rank=None):
    """train.py --health-check: the table from the last rank; one line naming the bad
    ranks, else go on."""
    lines, problems = check(grid, slow_rank)
    if grid.rank == grid.world - 1:
        print("\n".join(lines), flush=True)
    if problems:
        raise ValueError(
            f"--health-check: {'; '.join(problems)}; exclude that host or replace the device"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description="Check every rank's compute, correctness and links.")
    p.add_argument(
        "--slow-rank", type=int, default=None, help="testing: make this rank's matmul 4x slower"
    )
    p.add_argument(
        "--slow-factor", type=float, default=0.5, help="flag ranks below this x the median rate"
    )
    p.add_argument(
        "--ranks-as-hosts", action="store_true", help="testing: treat every rank as its own host"
    )

    p.add_argument("--device", default="auto", help="auto (CUDA where it is), cuda or cpu")
    args = p.parse_args(argv)
    dist.init(args.device)
    grid = dist.Grid(tdist.get_world_size(), 1, 1)
    lines, problems = check(grid, args.slow_rank, args.slow_factor, args.ranks_as_hosts)

    if grid.rank == 0:
        print("\n".join(lines), flush=True)
        for line in problems:
            print(f"health: {line}", file=sys.stderr, flush=True)
    tdist.destroy_process_group()
    return 5 if problems else 0


def cli():
    """The console script (pyproject [project.scripts])."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
