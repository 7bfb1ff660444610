"""Before a run: the memory check every start makes, and --dry-run, one rank built on paper.

check_memory refuses an absurd shape in one line before start-up; dry_run builds rank --rank of
any layout with compose.build on the meta device (meta.PaperGrid: no process group, no storage) and
prints its engine's bytes beside the planner's (tools/cost.py, tools/cost_moe.py).

    need  = max over stages of (params + grads + optimizer) bytes per rank    (the planner's count)
    have  = a GPU's memory, or the host's / LOCAL_WORLD_SIZE                  need > have: refused
    engine - planner = flat buffers padded to a multiple of dp + Adam's 4-byte step per piece

Lesson: lessons/15-3d-parallelism.md (the dry run), lessons/21-planning-a-run.md (the planner)
"""

import os
import time
from dataclasses import replace

import torch

from nanomega import compose, dist, formulas, fp8_gather, meta
from nanomega.gpt_config import SHAPE_KEYS
from nanomega.job import checks, flags
from nanomega.tools import cost, cost_moe
from nanomega.tools.cost_time import layer_seconds


def dry_run(config):
    """--dry-run: rank --rank of this layout built by compose.build on the meta device, its engine's
    parameter, gradient and optimizer bytes printed next to the planner's.
    Returns dict(engine=..., planner=..., groups, pieces, dp, seconds)."""
    config = checks.check(config)
    grid = meta.PaperGrid(
        config.dp,
        config.pp,
        config.tp,
        config.rank,
        cp=config.cp,
        ep=config.ep,
        dp_shard=config.dp_shard,
    )
    t0 = time.perf_counter()
    _, engine, _ = compose.build(config, grid)
    # Adam's state appears at its first step: take one on meta (no values)
    for piece in engine.pieces:
        piece.master.grad = torch.zeros_like(piece.master)
    engine.optimizer.step()
    held, seconds = engine.memory_bytes(), time.perf_counter() - t0

    # the planner's count of the same rank: its pipeline stage's row (experts / ep)
    planned = rank_state_bytes(config)[grid.pp_rank]
    planned = dict(zip(("params", "grads", "optimizer"), planned))

    # grid: meta.PaperGrid's repr
    print(
        f"dry run: {grid}, ZeRO-{config.zero}, {config.dtype}: built on meta in {seconds:.1f} s\n"
        f"{'':12} {'engine GB':>12} {'planner GB':>12} {'engine - planner (B)':>21}"
    )
    for k in planned:
        print(f"{k:<12} {held[k] / 1e9:12.3f} {planned[k] / 1e9:12.3f} {held[k] - planned[k]:21,}")
    print(
        f"(the difference: flat buffers padded to a multiple of dp in each of "
        f"{len(engine.groups)} groups, and Adam's 4-byte step counter per each of "
        f"{len(engine.pieces)} pieces)"
    )
    wired = engine.sharded is not None and isinstance(engine.sharded.wire, fp8_gather.FP8Gather)
    if wired:  # --fp8 at ZeRO-3: the weights gathered as FP8 codes (fp8_gather.py)
        fp8, base = fp8_gather.step_bytes(engine.sharded)
        print(
            f"--fp8 {config.fp8}, ZeRO-3: its FP8 weights' all-gathers move {fp8 / 1e6:.3f} MB per "
            f"micro-batch (1-byte codes + 4-byte amax), {base / 1e6:.3f} MB in {config.dtype}"
        )
    times = fp8_times(config) if config.fp8 != "off" else None
    for name, (fp8, peak, base, fast) in (times or {}).items():
        print(
            f"--fp8, planner: {name} at {fp8 / 1e12:,.0f} TFLOP/s FP8 ({peak / 1e12:,.0f} bf16): "
            f"one layer's forward + backward of a micro-batch {fast * 1e3:.4f} ms "
            f"({base * 1e3:.4f} ms without FP8)"
        )
    links = link_bytes(config, engine)
    if links is not None:  # --dp-shard: what crosses the slow link, against plain ZeRO over dp
        (inside, across), plain = links
        what = "ZeRO++ over hosts of" if engine.zeropp else "--dp-shard"
        print(
            f"{what} {grid.dp_shard.size} x {grid.dp_rep.size} replicas: per step this rank "
            f"sends {inside / 1e6:.3f} MB inside its host, {across / 1e6:.3f} MB across hosts "
            f"(plain ZeRO-{config.zero} over dp {config.dp}: {plain / 1e6:.3f} MB, all of it "
            f"through its slowest link; formulas.hybrid_comm_bytes / zeropp_comm_bytes)"
        )
    return dict(
        links=links,
        fp8_gather=fp8_gather.step_bytes(engine.sharded) if wired else None,
        fp8_times=times,
        engine=held,
        planner=planned,
        groups=len(engine.groups),
        pieces=len(engine.pieces),
        dp=config.dp,
        seconds=seconds,
    )


def fp8_times(config):
    """--fp8: the planner's one layer, forward + backward of one micro-batch at this layout's tp, on
    each GPU preset with a datasheet FP8 peak, without and with FP8 GEMMs (cost_time.layer_seconds):
    {gpu: (FP8 FLOP/s, bf16 FLOP/s, seconds, seconds with --fp8)}."""
    model = planner_model(config)
    run = cost.Run(
        micro_batch=config.batch_size,
        dtype=config.dtype,
        recompute=config.recompute,
        sp=config.sequence_parallel,
        attention="sdpa" if config.attention == "sdpa" else "eager",
    )
    return {
        name: (
            gpu.fp8_flops,
            gpu.peak_flops,
            layer_seconds(model, gpu, run, config.tp),
            layer_seconds(model, gpu, replace(run, fp8=True), config.tp),
        )
        for name, gpu in cost.GPUS.items()
        if gpu.fp8_flops
    }


def link_bytes(config, engine):
    """--dp-shard: ((inside, across), plain) bytes this rank sends per step for its dense weights'
    gradients and parameters (formulas.hybrid_comm_bytes over the engine's padded buffers, fp32
    gradients), and plain ZeRO's over all of dp; None without hybrid sharding."""
    plan, pb = engine.zeropp, engine.groups[0].full.element_size()
    if plan is not None:  # ZeRO++: ZeRO-3 over all of dp, its collectives compressed or inside
        sizes, hosts = [g.padded for g in engine.groups], (plan.inside.size, plan.across.size)
        zpp = dict(qwz=plan.qwz, hpz=plan.hpz, qgz=plan.qgz, m=config.grad_accum)
        links = formulas.zeropp_comm_bytes(sizes, *hosts, pb, **zpp)
        return links, formulas.dp_comm_bytes(sum(sizes), 3, config.dp, 4, pb, config.grad_accum)
    if engine.replicate is None:
        return None
    n = sum(g.padded for g in engine.groups if engine.rule[id(g)].replicate is not None)
    shard, rep = engine.axis.size, engine.replicate.size
    per = (4, pb, config.grad_accum)  # fp32 gradients, the weights' bytes, the micro-batches
    hybrid = formulas.hybrid_comm_bytes(n, config.zero, shard, rep, *per)
    return hybrid, formulas.dp_comm_bytes(n, config.zero, shard * rep, *per)


def check_memory(config):
    """An absurd shape (--n-embd 10000000) refused in one line before start-up, not by the
    allocator on every rank: one rank's parameter, gradient and optimizer bytes as the planner
    counts them (the activations come on top) against its share of memory: its GPU's, or the
    host's split among its ranks."""
    need = max(map(sum, rank_state_bytes(config)))

    if dist.default_device(config.device).type == "cuda":
        have, where = torch.cuda.get_device_properties(0).total_memory, "a GPU's"
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks
        where = f"this host's memory shared by {ranks} rank{'s' if ranks > 1 else ''}"

    if need > have:
        n = cost.n_params(planner_model(config))
        raise ValueError(
            f"the model ({n:,} parameters) needs {need / 1e9:,.3g} GB per rank for "
            f"its weights, gradients and optimizer state alone, more than {where}: "
            f"{have / 1e9:,.3g} GB; choose a smaller model, more ranks or --zero 3 "
            f"(python -m nanomega.tools.plan, --dry-run)"
        )


def zero_shards(config):
    """The ranks ZeRO shards over: hybrid sharding's S, or all of dp (ZeRO++'s hpZ/qgZ name the
    host with --dp-shard, their primary shards span dp)."""
    if config.zeropp_qwz or config.zeropp_hpz or config.zeropp_qgz:
        return config.dp
    return config.dp_shard or config.dp


def rank_state_bytes(config):
    """The planner's (params, grads, optimizer) bytes of one rank, per stage (experts / ep); Muon's
    matrices: one buffer, not Adam's two (cost_moe.muon_saved_bytes)."""
    out = cost_moe.rank_state_bytes(
        planner_model(config),
        config.tp,
        config.pp,
        zero_shards(config) * config.cp,  # ZeRO's shards: hybrid sharding's S
        config.zero,
        config.dtype,
        config.virtual_stages,
        ep=config.ep,
    )
    if config.optimizer != "muon":
        return out
    saved = cost_moe.muon_saved_bytes(
        planner_model(config),
        config.tp,
        config.pp,
        zero_shards(config) * config.cp,
        config.zero,
        config.virtual_stages,
        ep=config.ep,
    )
    return [(p, g, o - s) for (p, g, o), s in zip(out, saved)]


def planner_model(config):
    """The Config's model shape as the planner's cost.Model."""
    cfg = flags.model_config(config)
    return cost.Model.from_shape({k: getattr(cfg, k) for k in SHAPE_KEYS})
