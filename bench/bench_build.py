"""Peak host memory of building a ~1B-parameter model on 4 ranks: the dense build every rank used to
do (the whole fp32 GPT, then sliced) against the sharded build (nanomega/meta.py: the model on meta,
each rank drawing only its values into the engine's buffers), for tp 4 and for ZeRO-3 over dp 4.

    python bench/bench_build.py            # 4 spawned CPU ranks per build, one build kind after the other

Per rank: the peak resident set of its process during the build (ru_maxrss after the build minus the
resident set before it), the bytes its engine holds (ZeroEngine.memory_bytes) and the largest single
parameter. The sharded build should peak near what the rank keeps plus one parameter; the dense one
near the whole model.
Both builds draw the same values (test_meta.py proves the sharded one is the dense one, sliced,
bitwise).
"""

import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanomega import compose, dist, tp, worlds, zero, zero_rules  # noqa: E402
from nanomega.model import GPT  # noqa: E402
from nanomega.job import checks, flags  # noqa: E402

# 1.02B parameters with a 4,096 vocabulary
SHAPE = dict(n_layer=20, n_embd=2048, n_head=16, block_size=1024)
LAYOUTS = {"tp4": ["--tp", "4"], "zero3-dp4": ["--zero", "3"]}


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build(kind, layout):
    """One rank's build, measured. kind: dense (the former build) or sharded (compose.build now)."""
    config = checks.check(
        flags.parse(
            [
                *[f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()],
                *LAYOUTS[layout],
                "--dtype",
                "fp32",
            ]
        )
    )
    cfg = flags.model_config(config)
    grid = dist.Grid(config.dp, config.pp, config.tp)
    grid.barrier()
    before, t0 = rss(), time.perf_counter()
    if kind == "sharded":
        model, engine, _ = compose.build(config, grid)
    else:  # what every rank did before: the whole dense model on the host, then sliced or sharded
        model = GPT(cfg, seed=config.seed)
        if grid.tp.size > 1:
            tp.apply_tensor_parallel(model, grid.tp)
        engine = zero.ZeroEngine(
            model, torch.optim.AdamW, zero_rules.weight_decay_groups(0.1), grid, config.zero
        )
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    with torch.device("meta"):
        sizes = [p.numel() for p in GPT(cfg).parameters()]
    grid.barrier()
    return dict(
        rank=grid.rank,
        peak=peak,
        held=engine.memory_bytes(),
        seconds=seconds,
        params=sum(sizes),
        largest=4 * max(sizes),
    )


def main():
    rows = {}
    for layout in LAYOUTS:
        for kind in ("dense", "sharded"):
            rows[(layout, kind)] = worlds.launch(build, 4, kind, layout, timeout=1800)
            r0 = rows[(layout, kind)][0]
            peaks = " ".join(f"{r['peak'] / 1e9:5.2f}" for r in rows[(layout, kind)])
            print(
                f"{layout:>10} {kind:>8}: peak build RSS per rank (GB) {peaks} | engine holds "
                f"{sum(r0['held'].values()) / 1e9:.2f} GB (rank 0) | {r0['seconds']:.1f} s | "
                f"{r0['params'] / 1e9:.2f}B parameters, the largest {r0['largest'] / 1e9:.2f} GB",
                flush=True,
            )
    print(json.dumps({f"{k[0]}/{k[1]}": v for k, v in rows.items()}, default=str))


if __name__ == "__main__":
    main()
