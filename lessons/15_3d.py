"""Lesson 15 experiment: the rank grid, and the bytes each axis moves in one real training step."""

import gzip
import os
import tempfile

import torch

from check import check
from nanomega import dist, train, worlds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, S, H, M = 2, 32, 64, 4  # micro-batch, sequence, hidden, micro-batches per step


def one_step(corpus, out):
    """dp 2 x pp 2: train one step, return this rank's grid coordinates, traffic and stage size."""
    argv = [
        "--n-layer",
        "4",
        "--n-head",
        "4",
        "--n-embd",
        str(H),
        "--block-size",
        str(S),
        "--batch-size",
        str(B),
        "--grad-accum",
        str(M),
        "--pp",
        "2",
        "--max-steps",
        "1",
        "--eval-every",
        "0",
        "--peak-flops",
        "1e11",
        "--corpus",
        corpus,
        "--out-dir",
        out,
        "--log-every",
        "100",
    ]
    captured = {}
    real = dist.Grid.__init__

    def keep(self, *a, **kw):  # keep a handle on the grid train.main builds
        real(self, *a, **kw)
        captured["grid"] = self

    dist.Grid.__init__ = keep
    train.main(argv)
    grid = captured["grid"]
    return dict(
        coords=(grid.dp_rank, grid.pp_rank, grid.tp_rank),
        table=grid.log.table(),
        bytes={k: v[1] for k, v in grid.log.counts.items()},
    )


if __name__ == "__main__":
    print("the grid: ranks = arange(8).view(dp=2, pp=2, tp=2)")
    grid = torch.arange(8).view(2, 2, 2)
    print(
        "  tp groups (same node, fastest links):",
        [grid[d, p, :].tolist() for d in range(2) for p in range(2)],
    )
    print(
        "  pp groups (consecutive stages)      :",
        [grid[d, :, t].tolist() for d in range(2) for t in range(2)],
    )
    print(
        "  dp groups (replicas, outermost)     :",
        [grid[:, p, t].tolist() for p in range(2) for t in range(2)],
    )
    tmp = tempfile.mkdtemp()
    corpus = os.path.join(tmp, "small.txt")
    open(corpus, "w").write(
        gzip.open(os.path.join(ROOT, "data", "shakespeare.txt.gz"), "rt").read(200_000)
    )
    results = worlds.launch(one_step, 4, corpus, os.path.join(tmp, "out"))
    V, L = 4096, 4
    layer = 12 * H * H + 13 * H
    # embed+2 | 2+LN+head copy
    stage_params = [V * H + S * H + L // 2 * layer, L // 2 * layer + 2 * H + V * H]
    # wte, wpe | final LN, head copy; 12 per block
    stage_tensors = [2 + L // 2 * 12, L // 2 * 12 + 2 + 1]
    for r in results[:2]:  # dp rank 0: pipeline stages 0 and 1
        stage = r["coords"][1]
        print(f"rank {r['coords']} (dp, pp, tp):\n{r['table']}")
        # an end stage talks to one neighbour (stage 0 sends activations forward, the last stage
        # gradients backward); an interior stage (pp > 2) to two: 2 m b s h x 4 =
        # formulas.pp_comm_bytes
        n = (stage > 0) + (stage < 1)  # pp = 2 here: both stages are end stages
        check(
            f"stage {stage}: pp bytes sent = m b s h x 4 x neighbours ({n}: an end stage)",
            r["bytes"][("send", "pp", "float32")],
            n * M * B * S * H * 4,
        )
        check(
            f"stage {stage}: dp all-reduce = 4 x stage params + 4 (loss) + 4 x 4 (the step-end vote: save, stop, "
            f"a shard in flight, non-finite weights)",
            r["bytes"][("all_reduce", "dp", "float32")],
            4 * stage_params[stage] + 4 + 16,
        )
        check(
            f"stage {stage}: tied embedding all-reduce = 4 V h",
            r["bytes"][("all_reduce", "emb", "float32")],
            4 * V * H,
        )
        check(
            f"stage {stage}: start-up check of the replicas' weights = dp x 2 fp64 x tensors",
            r["bytes"][("all_gather", "dp", "float64")],
            2 * 2 * 8 * stage_tensors[stage],
        )
