"""AdamW vs Muon on README's model (nanomega/muon.py): the optimizer step's time in one process,
interleaved (the median of --repeats, each optimizer in turn, so a busy machine slows both alike),
and the bytes one dp rank sends per step at dp2 ZeRO-1 (a dry-run rank: the engine's own counts).

    python bench/bench_muon.py --repeats 21
"""

import argparse
import statistics
import time

import torch

from nanomega import compose, dist, meta, worlds
from nanomega.job import checks, flags


def engine(optimizer):
    """README's model (the flags' defaults), one process, the engine of --optimizer."""
    config = checks.check(flags.parse(["--optimizer", optimizer, "--device", "cpu"]))
    model, engine, _ = compose.build(config, dist.Grid(1, 1, 1))
    for piece in engine.pieces:
        piece.master.grad = torch.randn_like(piece.master) * 1e-2
    return engine


def step_times(repeats):
    engines = {name: engine(name) for name in ("adamw", "muon")}
    times = {name: [] for name in engines}
    for _ in range(repeats):
        for name, e in engines.items():
            t0 = time.perf_counter()
            e.optimizer.step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def bytes_at_dp2():
    """Per rank and step at dp2 ZeRO-1: AdamW's reduce-scatter + all-gather tensor bytes (4 Psi
    each) and Muon's exchange on top (owners.Owners.bytes_sent), from rank 0 built on meta."""
    out = {}
    for rank in (0, 1):
        argv = ["--optimizer", "muon", "--zero", "1", "--dry-run", "--world", "2"]
        config = checks.check(flags.parse(argv + ["--rank", str(rank)]))
        grid = meta.PaperGrid(config.dp, config.pp, config.tp, config.rank)
        _, e, _ = compose.build(config, grid)
        psi = sum(g.padded for g in e.groups)
        out[rank] = dict(zero1=2 * 4 * psi, muon=e.owners.bytes_sent(), owners=e.owners.table())
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    times = worlds.launch(step_times, 1, args.repeats)[0]
    print(f"optimizer step, median of {args.repeats} (interleaved), one process:")
    for name, t in times.items():
        print(f"  {name:6} {t * 1e3:8.2f} ms")
    for rank, b in bytes_at_dp2().items():
        print(
            f"dp2 ZeRO-1 rank {rank}: reduce-scatter + all-gather {b['zero1']:,} B/step; "
            f"Muon's exchange {b['muon']:,} B/step more\n  {b['owners']}"
        )


if __name__ == "__main__":
    main()
