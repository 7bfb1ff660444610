"""The training loop: one process of a job under any tp x pp x cp x ep x dp x ZeRO layout.

    python nanomega/train.py                                      # one process
    torchrun --nproc_per_node=4 nanomega/train.py --tp 2 --pp 2   # dp = world / (tp * pp) = 1

Read top-down: main -> train, the recipe (check the Config -> claim the out-dir -> find the
checkpoint -> start -> data -> compose.build -> resume -> loop) -> train_step -> forward_backward
-> evaluate; the helpers below them. The policies around the loop live in nanomega/job/, each
named: config.Config, flags.parse and checks.check (the flags: declared, read, a bad one refused,
pure), faults (the out-dir lock, resume discovery, preemption), guard.Guard (a step's failure
policy: hang watchdog, --inject-fault, spikes, NaN), saves (when to checkpoint, restore, roll
back), meter.MetricsLog (lines and metrics.jsonl).

    step = lr(step) -> this dp rank's micro-batches -> forward/backward (pipeline schedule, or a
           plain loop; no gradient sync until the last) -> engine.step (reduce, clip at
           --grad-clip, AdamW on owned shards, skip if not finite)
    MFU  = flops_per_token x tokens/s / (world x peak FLOP/s per device)   (meter.py: the peak)

Lessons: lessons/01-dense-model.md (the loop), lessons/15-3d-parallelism.md (compose.py)
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

from nanomega import compose, data, dist, documents, flash, moe, pp, precision, schedules, windows
from nanomega import mtp, post_validate
from nanomega.job import checks, faults, flags, health, lifecycle, meter, saves
from nanomega.job.guard import Guard, Spikes
from nanomega.tools import corpus, preflight


def main(argv=None):
    """Train as the command line says. The process group this call started (torchrun's, or a
    world of one) is ended after a clean end (dist.shutdown; NCCL warns about communicators left at
    exit); a launcher's (tests: worlds.launch) is left to it, and after an error the entrypoint
    still needs the store (lifecycle.lost_ranks)."""
    # the command line, read once into a frozen Config (nanomega/job/flags.py; job/config.py)
    config = flags.parse(argv)
    if config.dry_run:
        return preflight.dry_run(config)  # rank --rank built on paper (tools/preflight.py)
    started = not torch.distributed.is_initialized()
    # preemption signals, no orphans; the out-dir lock released at the end
    with lifecycle.job(config.out_dir):
        rec = train(config)
    if started and torch.distributed.is_initialized():
        dist.shutdown()
    return rec


def train(config):
    """The recipe: check, claim the out-dir, set up (grid, data, model, engine), resume, loop.
    Returns the last row."""
    # the flags checked (every check that needs no collective, before the first one; touches no
    # file), an absurd shape refused, the out-dir claimed (one job per out-dir: a lock; a killed
    # one's leftovers), --flash-restore's shared-memory copies, the checkpoint to resume found
    # (the newest verified one, or a flash.Found)
    config = checks.check(config)
    cfg = flags.model_config(config)
    preflight.check_memory(config)
    faults.claim_out_dir(config.out_dir, config.data_cache)
    # what a checkpoint records of this job's layout (and a resume compares)
    layout = saves.layout(config, data.tokenizer_sha256(data.get_tokenizer(config.tokenizer)))
    copies = flash.Copies(config.out_dir, faults.rank()) if config.flash_restore else None
    found = faults.find_checkpoint(
        config.out_dir,
        cfg,
        resume=config.resume,
        resume_from=config.resume_from,
        max_steps=config.max_steps,
        recorded=layout,
        allowed=faults.overrides(config),
        fast=copies and (copies, layout, checks.world_size()),
    )

    # start: the process group and grid, the data, this rank's model and engine, the resume
    grid = start(config, cfg)
    log = grid.rank == grid.world - 1  # the last rank: last pipeline stage, where the loss lives
    train_set, val_set = load_data(config, grid.world, log)
    checks.check_data(config, train_set)  # the batch fits, documents for --document-mask
    sampler = windows.Sampler(len(train_set), config.global_batch, config.seed)
    model, engine, n_params = compose.build(config, grid)  # the layout's pieces (compose.py)
    scaler = precision.LossScaler.for_dtype(precision.parse_dtype(config.dtype))
    spikes = Spikes(config.on_spike, config.spike_threshold, config.rollback_lr_factor)
    step, resume_from = resume(
        found,
        cfg,
        grid,
        layout,
        engine=engine,
        scaler=scaler,
        spikes=spikes,
        sampler=sampler,
        log=log,
        copies=copies,
    )

    # the policies around the loop: metrics (the start-up lines; MFU's peak), a step's failure
    # policy, checkpoints; from here on SIGTERM/SIGUSR1 checkpoint at the next step boundary
    metrics = meter.open_log(config, cfg, grid, step, n_params=n_params, log=log)
    guard = Guard(
        grid,
        spikes,
        on_nan=config.on_nan,
        max_skipped=config.max_skipped,
        fault=config.fault,
        hang_timeout=config.hang_timeout,
        out_dir=config.out_dir,
    )
    checkpoints = saves.Saves(
        config.out_dir,
        cfg,
        grid,
        layout,
        every=config.save_every,
        every_minutes=config.save_every_minutes,
        max_steps=config.max_steps,
        async_save=config.async_save,
        keep_last=config.keep_last,
        resumed_from=resume_from,
        copies=copies,
    )
    lifecycle.arm_preemption()

    # the loop: a step, its evaluation and row, then a rollback or a checkpoint
    if config.eval_every and step == 0:  # the starting point of the validation curve (~ ln V)
        metrics.log_validation(evaluate(model, grid, val_set, config))
    rec = {}
    while step < config.max_steps:
        rec, spike = train_step(
            step,
            config=config,
            model=model,
            engine=engine,
            grid=grid,
            sampler=sampler,
            train_set=train_set,
            scaler=scaler,
            guard=guard,
            metrics=metrics,
        )
        step = rec["step"]
        if config.eval_every and (step % config.eval_every == 0 or step == config.max_steps):
            with guard.paused():
                rec["val_loss"] = evaluate(model, grid, val_set, config)
        metrics.log_step(rec, spike=spike)
        # --max-skipped ("skipped" is the same on every rank: a reduced norm)
        guard.count(not rec["skipped"], step)
        if spike and config.on_spike == "rollback":
            step = checkpoints.roll_back(guard, step, engine=engine, scaler=scaler, spikes=spikes)
            metrics.reopen(step)  # the rows since that checkpoint are redone
            continue
        # the rank's state, built only to save
        state = functools.partial(saves.rank_state, engine, sampler, scaler, step, grid, spikes)
        if checkpoints.at_step_end(step, state=state, may_save=guard.may_save(), guard=guard):
            break  # preempted: checkpointed at this step boundary on every rank
    checkpoints.close(guard, step)
    metrics.close()
    return rec


def train_step(step, *, config, model, engine, grid, sampler, train_set, scaler, guard, metrics):
    """One optimizer step: lr(step) -> this dp rank's micro-batches -> forward/backward -> the
    loss agreed over dp and the gradient norm, read together (the one host sync before the
    update) -> engine.step. The guard decides around it (nanomega/job/guard.py): beats,
    --inject-fault, the spike decision, --on-nan. Returns (metrics row, spike)."""
    # the learning rate and this dp rank's micro-batches
    t0 = time.perf_counter()
    lr = lr_at(step, config) * guard.lr_scale
    engine.set_lr(lr)
    micro = sampler.local_micro_batches(
        sampler.step, grid.dp_rank, grid.dp.size, config.batch_size, config.grad_accum
    )
    batches = [
        to_device(documents.batch(train_set, idx, grid.cp, config.eot), grid.device)
        for idx in micro
    ]

    # forward and backward; step 1 of a pipeline saves its timeline, for nanomega.tools.plot
    traced = grid.pp.size > 1 and step == min(1, config.max_steps - 1)
    trace = schedules.Trace(grid.pp_rank) if traced else None
    with guard.forward_backward(model, step + 1, data_step=sampler.step + 1):
        loss = forward_backward(
            model, engine, grid, batches, config, loss_scale=scaler.scale, trace=trace
        )
    if trace and grid.dp_rank == 0 and grid.tp_rank == 0:
        save_trace(trace, config.out_dir)

    if config.post_validate:  # step at once, validate after (ZB-H2's: post_validate.py)
        loss, spike, info = post_validate.step(loss, engine, grid, guard, scaler, config.grad_clip)
    else:
        # the loss over dp_cp (cp: the token mean of the whole sequence) and the gradient norm's
        # square (on the device), read in one host sync, before the update
        loss = torch.as_tensor(loss, dtype=torch.float32, device=grid.device).reshape(1)
        loss = grid.dp_cp.all_reduce(guard.reported(loss))
        square = engine.reduce(scaler)
        total, norm = torch.cat([loss.double(), square.sqrt()]).tolist()
        loss = total / grid.dp_cp.size

        # the update, or its skip: the same decision on every rank. The weights' finite check
        # rides the step-boundary vote (saves.Saves): a count left on the device
        spike = guard.spike(loss)
        info = engine.step(
            clip_norm=config.grad_clip or None,
            scaler=scaler,
            skip=guard.drops(spike),
            norm=norm,
            check_finite=False,
        )
    info["nonfinite"] = engine.nonfinite_masters() if info["stepped"] else None
    sampler.advance()
    guard.finished(step + 1, loss, info)  # --on-nan stop

    # MoE: the step's aux loss and expert loads (the same on every rank), the router's bias (a
    # learner: it moves only on a step the engine took, as every other)
    routing = moe.step_stats(model, grid)
    if routing and config.moe_bias_balance and info["stepped"]:
        moe.update_bias(model, routing["load"], config.moe_bias_balance)

    # the step's row
    rec = metrics.row(
        step=step + 1,
        loss=loss,
        lr=lr,
        grad_norm=info["grad_norm"],
        skipped=not info["stepped"],
        started=t0,
    )
    rec.update(moe.row(routing) | mtp.step_stats(model, grid))  # MoE's and MTP's numbers
    return rec, spike


def forward_backward(model, engine, grid, batches, config, *, loss_scale=1.0, trace=None):
    """Mean loss over this rank's micro-batches; gradients (x loss_scale) left in the engine."""
    # the MoE aux losses' backward: the LM loss's factor
    moe.set_grad_scale(model, loss_scale / len(batches))
    mtp.prepare(model, grid, batches)  # MTP: each depth's valid targets over the step (mtp.py)
    if grid.pp.size > 1:
        return pp.train_step(
            model,
            grid,
            batches,
            schedule=config.schedule,
            no_sync=engine.no_sync,
            loss_scale=loss_scale,
            virtual=config.virtual_stages,
            act_shape=activation_shape(config, grid),
            trace=trace,
            deferred=config.post_validate,
        )

    # a plain loop: gradients kept local until the last micro-batch; the loss summed on the
    # device (no sync per micro-batch)
    total = torch.zeros((), dtype=torch.float64, device=grid.device)
    for i, batch in enumerate(batches):  # (x, y), or (x, y, document ids)
        with engine.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
            loss = model(*batch)
            (loss * (loss_scale / len(batches))).backward()
        total += loss.detach().double() / len(batches)
    return total


@torch.no_grad()
def evaluate(model, grid, val_set, config):
    """Mean loss per window over fixed validation windows: --eval-iters global batches (or all
    windows, when fewer), the same for every layout and every call (so curves compare), split over
    dp ranks like training batches. The windows may not fill the last micro-batch or split evenly
    over dp: each rank's mean is per window (pp.sequence_mean), summed over dp weighted by its
    windows, so every layout takes the same mean."""
    # the same windows for every layout and call, this dp rank's share of them
    model.eval()
    n = min(len(val_set), config.eval_iters * config.batch_size * config.grad_accum * grid.dp.size)
    order = torch.Generator().manual_seed(config.seed)
    idx = torch.randperm(len(val_set), generator=order)[:n].numpy()
    mine = idx[grid.dp_rank * n // grid.dp.size : (grid.dp_rank + 1) * n // grid.dp.size]
    batches = [
        documents.batch(val_set, mine[i : i + config.batch_size], grid.cp, config.eot)
        for i in range(0, len(mine), config.batch_size)
    ]
    batches = [to_device(b, grid.device) for b in batches]

    # the mean per window on this rank. A pipeline: every stage holds the same batches, each
    # receive sized by its micro-batch's rows
    if not batches:  # fewer windows than dp ranks: this one has none
        loss = 0.0
    elif grid.pp.size > 1:
        shape = activation_shape(config, grid)
        loss = pp.forward_only(model, grid, batches, shape, config.virtual_stages, config.schedule)
    else:
        losses = torch.stack([model(*b) for b in batches])
        loss = pp.sequence_mean(losses, [len(b[0]) for b in batches])
    model.train()

    # summed over dp weighted by windows. cp ranks: equal shares of each window's tokens, means
    # averaged; n >= 1 (TokenDataset refuses less)
    total = torch.tensor([loss * len(mine)], dtype=torch.float64, device=grid.device)
    return grid.dp_cp.all_reduce(total).item() / (n * grid.cp.size)


def lr_at(step, config):
    """Linear warm-up to --lr over --warmup steps, then cosine decay to --min-lr at --max-steps."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.max_steps - config.warmup))
    return config.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (config.lr - config.min_lr)


def load_data(config, world, log):
    """(train, val) windows: prepared shards (--data; or a many-file --corpus, prepared into the
    cache by corpus.py), or the single-file cache of data.prepare (one .txt file: the embedded
    default)."""
    cache = config.data_cache or os.path.join(config.out_dir, "data")
    files = None if config.data else data.corpus_files(config.corpus)

    # one .txt file: the single-file cache of data.prepare
    if files and len(files) == 1 and files[0].name.endswith((".txt", ".txt.gz")):
        meta = data.prepare(files[0], config.tokenizer, cache)
        return [
            windows.TokenDataset(meta[f"{s}_bin"], meta["dtype"], config.block_size)
            for s in ("train", "val")
        ]

    if config.data:
        index = data.load_index(config.data)
    else:
        index = corpus.cached(
            config.corpus,
            config.tokenizer,
            cache,
            workers=max(1, (os.cpu_count() or 1) // world),
            text_field=config.text_field,
            progress=log,
        )

    return [
        windows.TokenDataset(data.split_paths(index, s), index["dtype"], config.block_size)
        for s in ("train", "val")
    ]


def start(config, cfg):
    """torch.distributed, the device's matmul mode, the rank grid, and --health-check before
    anything else."""
    device = dist.init(config.device, config.collective_timeout)
    precision.set_tf32(device, config.tf32)
    grid = dist.Grid(config.dp, config.pp, config.tp, config.cp, config.ep, config.dp_shard)
    if config.health_check:
        health.gate(grid)
    if grid.rank == grid.world - 1 and config.model:
        llama = f", n_kv_head {cfg.kv_heads}, ffn_hidden {cfg.ffn}" if cfg.arch == "llama" else ""
        print(
            f"--model {config.model}: {cfg.arch}, n_layer {cfg.n_layer}, n_head {cfg.n_head}"
            f"{llama}, n_embd {cfg.n_embd}, block_size {cfg.block_size} "
            f"(nanomega/job/presets.py; explicit shape flags override it)"
        )
    return grid


def resume(found, cfg, grid, layout, *, engine, scaler, spikes, sampler, log, copies=None):
    """(the step to start from: 0, or that of the checkpoint found, its folder), loaded into this
    rank (--flash-restore: its own shard from its copy in shared memory where that holds the same
    bytes; the grid's vote: faults.settle)."""
    # --flash-restore: one vote on the fast discovery
    folder = faults.settle(found, cfg, grid, engine, log)
    if not folder:
        if copies:
            copies.reset()  # a fresh start: any copy left in shared memory is of no use
        return 0, None

    state = saves.restore(
        folder,
        cfg,
        grid,
        layout,
        engine=engine,
        scaler=scaler,
        spikes=spikes,
        sampler=sampler,
        copies=copies,
    )

    if log:
        how = "" if state.get("same_layout") else " (resharded)"
        print(f"resumed from {folder} at step {state['step']}{how}")

    if copies:
        # only a copy that served may serve again
        copies.reset(state["step"] if state["copies"] else None)
        # collective: every rank with --flash-restore is here
        (used,) = flash.count(grid, bool(state["copies"]))
        if log:
            disk = f" ({grid.world - used} read the disk)" if used < grid.world else ""
            print(f"restored from shared memory: {used} of {grid.world} ranks{disk}")
    return state["step"], folder


def to_device(tensors, device):
    """A host batch on the device: on CUDA through pinned memory, non-blocking (the copy overlaps
    compute)."""
    if device.type != "cuda":
        return tuple(t.to(device) for t in tensors)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)


def activation_shape(config, grid):
    """What flows between pipeline stages: (b, s, h), or (b, s/tp, h) with sequence parallelism."""
    s = config.block_size // grid.cp.size  # this cp rank's tokens
    s = s // grid.tp.size if config.sequence_parallel else s
    return (config.batch_size, s, config.n_embd)


def save_trace(trace, out_dir):
    """One pipeline rank's op spans (perf_counter: one clock for a host's processes) as JSON."""
    folder = os.path.join(out_dir, "pipeline_trace")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank_{trace.rank:03d}.json"), "w") as f:
        json.dump(dict(rank=trace.rank, events=[e._asdict() for e in trace.events]), f)


if __name__ == "__main__":
    lifecycle.entrypoint(main)  # expected failures: one line, recorded for torchrun's summary
