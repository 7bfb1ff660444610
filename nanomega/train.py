"""Train a GPT under any tp x pp x dp x ZeRO layout: the one composer.

    python nanomega/train.py                                      # one process
    torchrun --nproc_per_node=4 nanomega/train.py --tp 2 --pp 2   # dp = world / (tp * pp) = 1

Composition order (build): grid -> the model on the meta device (shapes only) -> tensor parallel -> pipeline
stage -> recompute -> fused kernels -> precision -> ZeRO/DP engine, which draws this rank's values straight into
its buffers (meta.py: bitwise the dense model's, sliced; no rank ever holds the dense model).
One step: lr(step) -> this dp rank's micro-batches -> forward/backward (pipeline schedule, or a plain loop; no
gradient sync until the last) -> engine.step (reduce, clip at 1.0, AdamW on owned shards, skip if not finite).
MFU = flops_per_token x tokens/s / (world x peak FLOP/s per device) (meter.py: the peak's source, memory).
Read `train` first, the recipe: check the Config -> claim the out-dir -> find the checkpoint -> start -> data
-> build -> resume -> loop of train_step. The policies around it live in nanomega/ops/, each named: flags.Config
and checks.check (the flags; a bad one refused, pure), faults (the out-dir lock, resume discovery, preemption),
guard.Guard (a step's failure policy: hang watchdog, --inject-fault, spikes, NaN), saves (when to checkpoint,
restore, roll back), meter.MetricsLog (lines and metrics.jsonl).
Lessons: lessons/01-dense-model.md (the loop), lessons/09-3d-parallelism.md (the composition).
"""
import contextlib
import functools
import json
import math
import os
import sys
import time

import torch

if __package__ in (None, ""):  # `python nanomega/train.py`: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanomega import (cp, data, dist, documents, ep, flash, fused, meta, moe, pp, precision, recompute, rng, schedules,
                      tp, windows, zero)
from nanomega.model import GPT, SHAPE_KEYS
from nanomega.ops import checks, faults, flags, health, lifecycle, meter, saves
from nanomega.ops.guard import Guard, Spikes
from nanomega.tools import corpus, cost, cost_moe


def lr_at(step, config):
    """Linear warm-up to --lr over --warmup steps, then cosine decay to --min-lr at --max-steps."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.max_steps - config.warmup))
    return config.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (config.lr - config.min_lr)


def load_data(config, world, log):
    """(train, val) windows: prepared shards (--data; or a many-file --corpus, prepared into the cache by
    corpus.py), or the single-file cache of data.prepare (one .txt file: the embedded default)."""
    cache = config.data_cache or os.path.join(config.out_dir, "data")
    files = None if config.data else data.corpus_files(config.corpus)
    if files and len(files) == 1 and files[0].name.endswith((".txt", ".txt.gz")):
        meta = data.prepare(files[0], config.tokenizer, cache)
        return [windows.TokenDataset(meta[f"{s}_bin"], meta["dtype"], config.block_size) for s in ("train", "val")]
    index = data.load_index(config.data) if config.data else corpus.cached(
        config.corpus, config.tokenizer, cache, workers=max(1, (os.cpu_count() or 1) // world),
        text_field=config.text_field, progress=log)
    return [windows.TokenDataset(data.split_paths(index, s), index["dtype"], config.block_size) for s in ("train", "val")]


def build(config, cfg, grid):
    """The model pieces this rank holds, and the engine that owns their optimizer state. The model is built on
    the meta device and sliced there; the engine then draws this rank's values of the dense model from
    --seed into its flat buffers on grid.device (meta.py). On a meta grid (--dry-run) nothing is drawn."""
    with torch.device("meta"):
        model = GPT(cfg, seed=config.seed)  # shapes only: every parallel form below slices shapes
    n_params = sum(p.numel() for p in model.parameters())
    tracker = rng.model_parallel_seed(config.seed, grid)
    if grid.tp.size > 1:
        tp.apply_tensor_parallel(model, grid.tp, config.sequence_parallel, tracker)
    if cfg.n_experts:  # this ep rank's experts only (ep.py)
        ep.apply_expert_parallel(model, grid.ep)
    cp.apply_context_parallel(model, grid.cp, config.cp_method)  # attention over the cp axis; positions per chunk
    shared = None
    if grid.pp.size > 1:
        pp.build_stage(model, grid, config.virtual_stages)
        shared = pp.tied_embedding(model, grid)
    recompute.apply_recompute(model, config.recompute, config.recompute_layers)
    if config.fused:
        fused.apply_fused(model)
    if config.attention == "fused":  # the eager core with our fused scale-mask-softmax kernel
        fused.apply_fused_softmax(model)
    precision.cast_model(model, precision.parse_dtype(config.dtype))
    init = meta.Init(cfg, config.seed, grid.tp_rank, grid.tp.size)  # the dense init, seen from this tp rank
    meta.materialize(model, init, grid.device, params=False)  # buffers; the engine draws the parameters
    if config.compile:  # per block, as torchtitan: small graphs compile fast; names and hooks of the module stay
        for block in model.blocks.values():
            block.compile()
    # fused AdamW on CUDA (one kernel for all tensors); the CPU keeps foreach, the arithmetic of every fingerprint
    options = dict(betas=(0.9, 0.95), fused=True) if grid.device.type == "cuda" else dict(betas=(0.9, 0.95))
    engine = zero.ZeroEngine(model, torch.optim.AdamW, zero.weight_decay_groups(config.weight_decay, **options),
                             grid, config.zero, shared=shared, values=init.values, offload=config.offload,
                             offload_params=config.offload_params)
    return model, engine, n_params


def forward_backward(model, engine, grid, batches, config, *, loss_scale=1.0, trace=None):
    """Mean loss over this rank's micro-batches; gradients (x loss_scale) left in the engine's buffers."""
    moe.set_grad_scale(model, loss_scale / len(batches))  # the MoE aux losses' backward: the LM loss's factor
    if grid.pp.size > 1:
        return pp.train_step(model, grid, batches, schedule=config.schedule, no_sync=engine.no_sync,
                             loss_scale=loss_scale, virtual=config.virtual_stages,
                             act_shape=activation_shape(config, grid), trace=trace)
    total = torch.zeros((), dtype=torch.float64, device=grid.device)  # summed on the device: no sync per micro-batch
    for i, batch in enumerate(batches):  # (x, y), or (x, y, document ids)
        with engine.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
            loss = model(*batch)
            (loss * (loss_scale / len(batches))).backward()
        total += loss.detach().double() / len(batches)
    return total


def to_device(tensors, device):
    """A host batch on the device: on CUDA through pinned memory, non-blocking (the copy overlaps compute)."""
    if device.type != "cuda":
        return tuple(t.to(device) for t in tensors)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)


def activation_shape(config, grid):
    """What flows between pipeline stages: (b, s, h), or (b, s/tp, h) with sequence parallelism."""
    s = config.block_size // grid.cp.size  # this cp rank's tokens
    s = s // grid.tp.size if config.sequence_parallel else s
    return (config.batch_size, s, config.n_embd)


@torch.no_grad()
def evaluate(model, grid, val_set, config):
    """Mean loss per window over fixed validation windows: --eval-iters global batches (or all windows, when
    fewer), the same for every layout and every call (so curves compare), split over dp ranks like training
    batches. The windows may not fill the last micro-batch or split evenly over dp: each rank's mean is per
    window (pp.sequence_mean), summed over dp weighted by its windows, so every layout takes the same mean."""
    model.eval()
    n = min(len(val_set), config.eval_iters * config.batch_size * config.grad_accum * grid.dp.size)
    idx = torch.randperm(len(val_set), generator=torch.Generator().manual_seed(config.seed))[:n].numpy()
    mine = idx[grid.dp_rank * n // grid.dp.size:(grid.dp_rank + 1) * n // grid.dp.size]
    batches = [to_device(documents.batch(val_set, mine[i:i + config.batch_size], grid.cp, config.eot), grid.device)
               for i in range(0, len(mine), config.batch_size)]
    if not batches:  # fewer windows than dp ranks: this one has none
        loss = 0.0
    elif grid.pp.size > 1:  # every stage holds the same batches: each receive is sized by its micro-batch's rows
        loss = pp.forward_only(model, grid, batches, activation_shape(config, grid), virtual=config.virtual_stages)
    else:
        loss = pp.sequence_mean(torch.stack([model(*b) for b in batches]), [len(b[0]) for b in batches])
    model.train()
    total = torch.tensor([loss * len(mine)], dtype=torch.float64, device=grid.device)
    # cp ranks: equal shares of each window's tokens, means averaged; n >= 1 (TokenDataset refuses less)
    return grid.dp_cp.all_reduce(total).item() / (n * grid.cp.size)


def main(argv=None):
    """Train as the command line says. The process group this call started (torchrun's, or a world of one) is
    ended after a clean end (dist.shutdown; NCCL warns about communicators left at exit); a launcher's (tests:
    worlds.launch) is left to it, and after an error the entrypoint still needs the store (lifecycle.lost_ranks)."""
    config = flags.parse(argv)  # the command line, read once into a frozen Config (nanomega/ops/flags.py)
    if config.dry_run:
        return dry_run(config)
    started = not torch.distributed.is_initialized()
    with lifecycle.job(config.out_dir):  # preemption signals, no orphans; the out-dir lock released at the end
        rec = train(config)
    if started and torch.distributed.is_initialized():
        dist.shutdown()
    return rec


def train(config):
    """The recipe: check, claim the out-dir, set up (grid, data, model, engine), resume, loop. Returns the last row."""
    config = checks.check(config)  # every check that needs no collective, before the first one; touches no file
    cfg = flags.model_config(config)
    check_memory(config, cfg)
    faults.claim_out_dir(config.out_dir, config.data_cache)  # one job per out-dir (a lock); a killed one's leftovers
    tokenizer = (config.tokenizer, data.tokenizer_sha256(data.get_tokenizer(config.tokenizer)))
    layout = saves.layout(config, tokenizer[1])  # what a checkpoint records of this job's layout
    copies = flash.Copies(config.out_dir, faults.rank()) if config.flash_restore else None  # shared-memory copies
    found = faults.find_checkpoint(config.out_dir, cfg, resume=config.resume, resume_from=config.resume_from,
                                   max_steps=config.max_steps, tokenizer=tokenizer,  # the newest verified one
                                   allow_tokenizer_change=config.allow_tokenizer_change,
                                   fast=copies and (copies, layout, checks.world_size()))  # or a flash.Found
    grid = start(config, cfg)
    log = grid.rank == grid.world - 1  # the last rank: last pipeline stage, where the loss lives
    train_set, val_set = load_data(config, grid.world, log)
    checks.check_batch_fits(config, len(train_set))
    sampler = windows.Sampler(len(train_set), config.global_batch, config.seed)
    model, engine, n_params = build(config, cfg, grid)
    scaler = precision.LossScaler.for_dtype(precision.parse_dtype(config.dtype))
    spikes = Spikes(config.on_spike, config.spike_threshold, config.rollback_lr_factor)
    step, resume_from = resume(found, cfg, grid, layout, engine=engine, scaler=scaler, spikes=spikes, sampler=sampler,
                               log=log, copies=copies)

    metrics = meter.open_log(config, cfg, grid, step, n_params=n_params, log=log)  # the start-up lines; MFU's peak
    guard = Guard(grid, spikes, on_nan=config.on_nan, max_skipped=config.max_skipped, fault=config.fault,
                  hang_timeout=config.hang_timeout, out_dir=config.out_dir)  # a step's failure policy
    checkpoints = saves.Saves(config.out_dir, cfg, grid, layout, every=config.save_every,
                              every_minutes=config.save_every_minutes, max_steps=config.max_steps,
                              async_save=config.async_save, keep_last=config.keep_last, resumed_from=resume_from,
                              copies=copies)
    lifecycle.arm_preemption()  # from here on SIGTERM/SIGUSR1 checkpoint at the next step boundary
    if config.eval_every and step == 0:  # the starting point of the validation curve (~ ln V)
        metrics.log_validation(evaluate(model, grid, val_set, config))
    rec = {}
    while step < config.max_steps:
        rec, spike = train_step(step, config=config, model=model, engine=engine, grid=grid, sampler=sampler,
                                train_set=train_set, scaler=scaler, guard=guard, metrics=metrics)
        step = rec["step"]
        if config.eval_every and (step % config.eval_every == 0 or step == config.max_steps):
            with guard.paused():
                rec["val_loss"] = evaluate(model, grid, val_set, config)
        metrics.log_step(rec, spike=spike)
        guard.count(not rec["skipped"], step)  # --max-skipped ("skipped" is the same on every rank: a reduced norm)
        if spike and config.on_spike == "rollback":
            step = checkpoints.roll_back(guard, step, engine=engine, scaler=scaler, spikes=spikes)
            metrics.reopen(step)  # the rows since that checkpoint are redone
            continue
        state = functools.partial(saves.rank_state, engine, sampler, scaler, step, grid, spikes)  # built only to save
        if checkpoints.at_step_end(step, state=state, may_save=guard.may_save(), guard=guard):
            break  # preempted: checkpointed at this step boundary on every rank
    checkpoints.close(guard, step)
    metrics.close()
    return rec


def dry_run(config):
    """--dry-run: rank --rank of this layout built by build() on the meta device (meta.PaperGrid: no process
    group, no storage), its engine's parameter, gradient and optimizer bytes printed next to the planner's
    (tools/cost.py). Returns dict(engine=..., planner=..., groups, pieces, dp, seconds)."""
    config = checks.check(config)
    cfg = flags.model_config(config)
    grid = meta.PaperGrid(config.dp, config.pp, config.tp, config.rank, cp=config.cp, ep=config.ep)
    t0 = time.perf_counter()
    _, engine, _ = build(config, cfg, grid)
    for piece in engine.pieces:  # Adam's state appears at its first step: take one on meta (no values)
        piece.master.grad = torch.zeros_like(piece.master)
    engine.optimizer.step()
    held, seconds = engine.memory_bytes(), time.perf_counter() - t0
    model = cost.Model.from_shape({k: getattr(cfg, k) for k in SHAPE_KEYS})
    planned = cost_moe.rank_state_bytes(model, config.tp, config.pp, config.dp * config.cp, config.zero, config.dtype,
                                        config.virtual_stages, ep=config.ep)[grid.pp_rank]  # experts / ep
    planned = dict(zip(("params", "grads", "optimizer"), planned))
    print(f"dry run: {grid}, ZeRO-{config.zero}, {config.dtype}: built on meta in {seconds:.1f} s\n{'':12} "
          f"{'engine GB':>12} {'planner GB':>12} {'engine - planner (B)':>21}")  # grid: meta.PaperGrid's repr
    for k in planned:
        print(f"{k:<12} {held[k] / 1e9:12.3f} {planned[k] / 1e9:12.3f} {held[k] - planned[k]:21,}")
    print(f"(the difference: flat buffers padded to a multiple of dp in each of {len(engine.groups)} groups, and "
          f"Adam's 4-byte step counter per each of {len(engine.pieces)} pieces)")
    return dict(engine=held, planner=planned, groups=len(engine.groups), pieces=len(engine.pieces),
                dp=config.dp, seconds=seconds)


def check_memory(config, cfg):
    """An absurd shape (--n-embd 10000000) refused in one line before start-up, not by the allocator on every
    rank: one rank's parameter, gradient and optimizer bytes as the planner counts them (tools/cost.py; the
    activations come on top) against its share of memory: its GPU's, or the host's split among its ranks."""
    model = cost.Model.from_shape({k: getattr(cfg, k) for k in SHAPE_KEYS})
    need = max(map(sum, cost_moe.rank_state_bytes(model, config.tp, config.pp, config.dp * config.cp, config.zero,
                                                  config.dtype, config.virtual_stages, ep=config.ep)))  # experts / ep
    if dist.default_device(config.device).type == "cuda":
        have, where = torch.cuda.get_device_properties(0).total_memory, "a GPU's"
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks, \
            f"this host's memory shared by {ranks} rank{'s' if ranks > 1 else ''}"
    if need > have:
        raise ValueError(f"the model ({cost.n_params(model):,} parameters) needs {need / 1e9:,.3g} GB per rank for "
                         f"its weights, gradients and optimizer state alone, more than {where}: {have / 1e9:,.3g} GB; "
                         f"choose a smaller model, more ranks or --zero 3 (python -m nanomega.tools.plan, --dry-run)")


def start(config, cfg):
    """torch.distributed, the device's matmul mode, the rank grid, and --health-check before anything else."""
    device = dist.init(config.device, config.collective_timeout)
    precision.set_tf32(device, config.tf32)
    grid = dist.Grid(config.dp, config.pp, config.tp, cp=config.cp, ep=config.ep)
    if config.health_check:
        health.gate(grid)
    if grid.rank == grid.world - 1 and config.model:
        llama = f", n_kv_head {cfg.kv_heads}, ffn_hidden {cfg.ffn}" if cfg.arch == "llama" else ""
        print(f"--model {config.model}: {cfg.arch}, n_layer {cfg.n_layer}, n_head {cfg.n_head}{llama}, n_embd "
              f"{cfg.n_embd}, block_size {cfg.block_size} (nanomega/ops/presets.py; explicit shape flags override it)")
    return grid


def resume(found, cfg, grid, layout, *, engine, scaler, spikes, sampler, log, copies=None):
    """(the step to start from: 0, or that of the checkpoint found, its folder), loaded into this rank (--flash-restore:
    its own shard from its copy in shared memory where that holds the same bytes; the grid's vote: faults.settle)."""
    folder = faults.settle(found, cfg, grid, engine, log)  # --flash-restore: one vote on the fast discovery
    if not folder:
        if copies:
            copies.reset()  # a fresh start: any copy left in shared memory is of no use
        return 0, None
    state = saves.restore(folder, cfg, grid, layout, engine=engine, scaler=scaler, spikes=spikes, sampler=sampler,
                          copies=copies)
    if log:
        print(f"resumed from {folder} at step {state['step']}" + ("" if state.get("same_layout") else " (resharded)"))
    if copies:
        copies.reset(state["step"] if state["copies"] else None)  # only a copy that served may serve again
        used, = flash.count(grid, bool(state["copies"]))  # collective: every rank with --flash-restore is here
        if log:
            print(f"restored from shared memory: {used} of {grid.world} ranks" +
                  (f" ({grid.world - used} read the disk)" if used < grid.world else ""))
    return state["step"], folder


def train_step(step, *, config, model, engine, grid, sampler, train_set, scaler, guard, metrics):
    """One optimizer step: lr(step) -> this dp rank's micro-batches -> forward/backward -> the loss agreed over
    dp and the gradient norm, read together (the one host sync before the update) -> engine.step. The guard
    decides around it (nanomega/ops/guard.py): beats, --inject-fault, the spike decision, --on-nan.
    Returns (metrics row, spike)."""
    t0 = time.perf_counter()
    lr = lr_at(step, config) * guard.lr_scale
    engine.set_lr(lr)
    micro = sampler.local_micro_batches(sampler.step, grid.dp_rank, grid.dp.size, config.batch_size, config.grad_accum)
    batches = [to_device(documents.batch(train_set, idx, grid.cp, config.eot), grid.device) for idx in micro]
    trace = schedules.Trace(grid.pp_rank) if grid.pp.size > 1 and step == min(1, config.max_steps - 1) else None
    with guard.forward_backward(model, step + 1, data_step=sampler.step + 1):
        loss = forward_backward(model, engine, grid, batches, config, loss_scale=scaler.scale, trace=trace)
    if trace and grid.dp_rank == 0 and grid.tp_rank == 0:  # step 1's pipeline timeline, for nanomega.tools.plot
        save_trace(trace, config.out_dir)
    loss = grid.dp_cp.all_reduce(guard.reported(torch.as_tensor(loss, dtype=torch.float32, device=grid.device)
                                                .reshape(1)))  # cp: the token mean of the whole sequence
    square = engine.reduce(scaler)  # the gradient norm's square, on the device
    total, norm = torch.cat([loss.double(), square.sqrt()]).tolist()  # one host sync for both, before the update
    loss = total / grid.dp_cp.size
    spike = guard.spike(loss)  # the same decision on every rank
    info = engine.step(clip_norm=config.grad_clip or None, scaler=scaler, skip=guard.drops(spike), norm=norm,
                       vote=True)  # the weights' finite check rides the step-boundary vote (saves.Saves)
    sampler.advance()
    guard.finished(step + 1, loss, info)  # --on-nan stop
    routing = moe.step_stats(model, grid)  # MoE: the step's aux loss and expert loads, the same on every rank
    if routing and config.moe_bias_balance:
        moe.update_bias(model, routing["load"], config.moe_bias_balance)
    rec = metrics.row(step=step + 1, loss=loss, lr=lr, grad_norm=info["grad_norm"], skipped=not info["stepped"],
                      seconds=time.perf_counter() - t0)
    if routing:
        load = routing["load"]  # (n_layer, E): max load / mean load, 1 when balanced
        rec.update(moe_aux=routing["aux"], moe_max_load=(load.max(1).values / load.mean(1)).max().item())
    return rec, spike


def save_trace(trace, out_dir):
    """One pipeline rank's op spans (perf_counter: one clock for the processes of a host) as JSON."""
    folder = os.path.join(out_dir, "pipeline_trace")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank_{trace.rank:03d}.json"), "w") as f:
        json.dump(dict(rank=trace.rank, events=[e._asdict() for e in trace.events]), f)


if __name__ == "__main__":
    lifecycle.entrypoint(main)  # expected failures: one line, recorded for torchrun's summary
