"""Lesson 17 experiment: ZeRO++ on 2 hosts x 2 ranks -- the bytes each scheme puts on each link.

Four CPU ranks grouped as two hosts of two (dist.Grid(4, dp_shard=2): the shard group is a host,
the replicate group one rank per host). ZeRO-3 over all four, one step of 2 micro-batches, with
each ZeRO++ scheme alone and all three together; per rank, the bytes the counted collectives sent
inside a host (the dps axis) and across hosts (dp, whose ring spans both, and dpr), next to
formulas.zeropp_comm_bytes from the engine's padded buffers. Then the first loss of each scheme
against plain ZeRO-3: the compression's effect on the numbers, before any step changes them.
"""

import torch

from check import check
from nanomega import dist, formulas, worlds, zeropp
from nanomega.dist import RING
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.zero import ZeroEngine
from nanomega.zero_rules import Replicas, weight_decay_groups

CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
ACCUM = 2
SCHEMES = {
    "plain ZeRO-3": dict(),
    "qwZ int8": dict(qwz=8),
    "qwZ int4": dict(qwz=4),
    "hpZ": dict(hpz=True),
    "qgZ int8": dict(qgz=8),
    "qgZ int4": dict(qgz=4),
    "all three (8-bit)": dict(qwz=8, hpz=True, qgz=8),
}


def links(log):
    """(inside, across) bytes this rank sent: rings on their ring factor, all-to-alls as sent."""
    inside = RING["all_gather"](2) * log.bytes("all_gather", "dps") + log.bytes("all_to_all", "dps")
    across = sum(RING[op](4) * log.bytes(op, "dp") for op in ("all_gather", "reduce_scatter"))
    return inside, across + log.bytes("all_to_all", "dpr")


def run():
    """On every rank: one step per scheme; its bytes per link, the formula's, its first loss."""
    grid, out = dist.Grid(4, 1, 1, dp_shard=2), {}
    for name, scheme in SCHEMES.items():
        torch.manual_seed(0)
        plan = zeropp.Plan(**scheme, inside=grid.dp_shard, across=grid.dp_rep)
        engine = ZeroEngine(
            GPT(CFG),
            torch.optim.AdamW,
            weight_decay_groups(0.1, lr=1e-3),
            grid,
            3,
            bucket_mb=0.1,
            replicas=[Replicas("dense", grid.dp)],
            zeropp=plan,
        )
        grid.log.reset()
        loss = torch.zeros(1)
        for m in range(ACCUM):
            g = torch.Generator().manual_seed(10 * grid.rank + m)
            x, y = (torch.randint(0, 128, (2, 32), generator=g) for _ in range(2))
            part = engine.module(x, y) / ACCUM
            part.backward()
            loss += part.detach()
        engine.step(clip_norm=1.0)
        sizes = [g.padded for g in engine.groups]
        formula = formulas.zeropp_comm_bytes(sizes, 2, 2, 4, **scheme, m=ACCUM)
        out[name] = (links(grid.log), formula, grid.dp.all_reduce(loss).item() / 4)
    return out


def main():
    ranks = worlds.launch(run, 4)
    print("2 hosts x 2 ranks, ZeRO-3 over 4, fp32, 2 micro-batches; MB one rank sends per step")
    print(f"{'scheme':>18} {'inside':>8} {'formula':>8} {'across':>8} {'formula':>8}  first loss")
    plain = ranks[0]["plain ZeRO-3"]
    for name in SCHEMES:
        (inside, across), (f_in, f_across), loss = ranks[0][name]
        print(
            f"{name:>18} {inside / 1e6:8.3f} {f_in / 1e6:8.3f} {across / 1e6:8.3f} "
            f"{f_across / 1e6:8.3f}  {loss:.6f}"
        )
    for name in SCHEMES:  # every rank's counters against the formula
        worst = max(abs(a - b) for r in ranks for a, b in zip(r[name][0], r[name][1]))
        check(f"{name}, bytes per link off the formula on any rank", worst, 0, unit=" B")
    (_, across), (_, f_across), _ = ranks[0]["all three (8-bit)"]
    check(
        "all three: share of plain ZeRO-3's bytes across hosts",
        across / plain[0][1],
        f_across / plain[1][1],
        rtol=1e-12,
    )


if __name__ == "__main__":
    main()
