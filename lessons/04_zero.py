"""Lesson 04 experiment: ZeRO stages 0-3 at 2 and 4 CPU ranks -- bytes held and bytes sent, next to
the formulas.

A bf16 GPT with bf16 gradients and fp32 AdamW (the 2 + 2 + 12 = 16 bytes of the table), every
parameter size a multiple of 4 so no shard needs padding. Memory: the tensors the engine holds at
the step -- after backward, before the update (engine.memory_bytes) -- and, for ZeRO-3, between
steps, when it has freed its gradient shard too.
Traffic: the bytes one rank sends in one step, from dist.py's counted collectives and the ring
factors.
ZeRO-Offload (offload.py) at stages 1 and 2: the bytes copied per step between device and host (here
host to host), counted by the engine's Offload: its bf16 gradient slice down, its bf16 weight slice
up.
"""

import torch

from check import check
from nanomega import dist, worlds
from nanomega.dist import RING
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.precision import cast_model
from nanomega.zero import ZeroEngine
from nanomega.zero_rules import weight_decay_groups

CFG = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
PER_PARAM = {
    0: lambda n: (2, 2, 12),
    1: lambda n: (2, 2, 12 / n),
    2: lambda n: (2, 2 / n, 12 / n),
    # (16-bit weights, 16-bit gradients, fp32 master + Adam m, v)
    3: lambda n: (2 / n, 2 / n, 12 / n),
}


def run_stages(world):
    """On every rank: one warm-up step (Adam's state appears), then one measured step, per stage."""
    grid, out = dist.Grid(world, 1, 1), {}
    g = torch.Generator().manual_seed(grid.rank)
    x, y = torch.randint(0, 100, (2, 32), generator=g), torch.randint(0, 100, (2, 32), generator=g)
    for stage in range(4):
        torch.manual_seed(0)
        model = cast_model(GPT(CFG), torch.bfloat16)
        engine = ZeroEngine(
            model,
            torch.optim.AdamW,
            weight_decay_groups(0.1, lr=1e-3),
            grid,
            stage,
            bucket_mb=0.1,
            grad_dtype=torch.bfloat16,
        )
        for _step in range(2):
            grid.log.reset()
            loss = model(x, y)
            loss.backward()
            # at the step: the gradients are reduced, Adam's state exists
            memory = engine.memory_bytes()
            engine.step(clip_norm=1.0)
        out[stage] = dict(
            memory=memory,
            pieces=len(engine.pieces),
            loss=loss.item(),
            between=engine.memory_bytes()["grads"],
            bytes={op: grid.log.bytes(op, "dp") for op in RING},
        )
    # ZeRO-Offload: the optimizer state of every group on the host, stepped by the CPU Adam
    for stage in (1, 2):
        torch.manual_seed(0)
        model = cast_model(GPT(CFG), torch.bfloat16)
        engine = ZeroEngine(
            model,
            torch.optim.AdamW,
            weight_decay_groups(0.1, lr=1e-3),
            grid,
            stage,
            bucket_mb=0.1,
            grad_dtype=torch.bfloat16,
            offload=1.0,
        )
        for _step in range(2):
            before = dict(engine.offload.moved)
            model(x, y).backward()
            engine.step(clip_norm=1.0)
        out["offload", stage] = dict(
            moved={k: v - before[k] for k, v in engine.offload.moved.items()}
        )
    return out


def report(world, res, psi):
    print(f"\n--- N = {world} data-parallel ranks, Psi = {psi:,} parameters (rank 0) ---")
    print("stage   weights     grads  optimizer      total   bytes/param   loss (step 2)")
    offload = {k: res.pop(k) for k in list(res) if isinstance(k, tuple)}  # ("offload", stage)
    for stage, r in res.items():
        m = r["memory"]
        total = m["params"] + m["grads"] + m["optimizer"]
        print(
            f"ZeRO-{stage} {m['params']:9,} {m['grads']:9,} {m['optimizer']:10,} {total:10,} "
            f"{total / psi:11.2f}   {r['loss']:.4f}"
        )
    for stage, r in res.items():
        m, (w, gr, opt) = r["memory"], PER_PARAM[stage](world)
        # + 4 bytes per optimizer tensor: AdamW's step counter (one per parameter piece this rank
        # updates)
        check(
            f"N={world} ZeRO-{stage} bytes held by rank 0 = ({w:g} + {gr:g} + {opt:g}) Psi + 4 x {r['pieces']} steps",
            m["params"] + m["grads"] + m["optimizer"],
            (w + gr + opt) * psi + 4 * r["pieces"],
            unit=" B",
        )
    check(
        f"N={world} ZeRO-3 gradient bytes held between steps (the shard is freed after the update)",
        res[3]["between"],
        0,
        unit=" B",
    )
    ring = lambda op, r: RING[op](world) * r["bytes"][op]  # noqa: E731  bytes this rank sends
    dp = ring("all_reduce", res[0])
    check(
        f"N={world} DP all-reduce sends 2(N-1)/N x 2 Psi",
        dp,
        2 * (world - 1) / world * 2 * psi,
        unit=" B",
    )
    for stage in (1, 2, 3):
        moved = ring("reduce_scatter", res[stage]) + ring("all_gather", res[stage])
        # reduce-scatter + all-gather (+ a second all-gather in backward)
        passes = 3 if stage == 3 else 2
        check(
            f"N={world} ZeRO-{stage} reduce-scatter + all-gather send {passes}(N-1)/N x 2 Psi",
            moved,
            passes * (world - 1) / world * 2 * psi,
            unit=" B",
        )
    check(
        f"N={world} ZeRO-3 bytes / DP bytes",
        (ring("reduce_scatter", res[3]) + ring("all_gather", res[3])) / dp,
        1.5,
    )
    # the gradient slice down, the bf16 weights of the slice up: 2 + 2 bytes
    for (_, stage), r in offload.items():
        check(
            f"N={world} ZeRO-{stage} + offload: bytes copied per step, device -> host + host -> device = "
            f"(2 + 2) Psi / N",
            r["moved"]["down"] + r["moved"]["up"],
            4 * psi / world,
            unit=" B",
        )


if __name__ == "__main__":
    psi = sum(p.numel() for p in GPT(CFG).parameters())
    print(
        "bytes per parameter, mixed precision with Adam: 2 (bf16 weight) + 2 (bf16 gradient) + 4 (fp32 master) "
        "+ 4 + 4 (Adam m, v) = 16"
    )
    for n in (2, 4):
        print(
            "formula per rank: "
            + ", ".join(f"ZeRO-{s} {sum(PER_PARAM[s](n)):.2f}" for s in range(4))
            + f" bytes/param at N={n}"
        )
    for world in (2, 4):
        report(world, worlds.launch(run_stages, world, world, timeout=300)[0], psi)
