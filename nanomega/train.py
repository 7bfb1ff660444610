"""Train a GPT under any tp x pp x dp x ZeRO layout: the one composer.

    python nanomega/train.py                                      # one process
    torchrun --nproc_per_node=4 nanomega/train.py --tp 2 --pp 2   # dp = world / (tp * pp) = 1

Composition order (build): grid -> dense model (same seed everywhere) -> tensor parallel -> pipeline stage
-> recompute -> fused kernels -> precision -> ZeRO/DP engine. One step: lr(step) -> this dp rank's
micro-batches -> forward/backward (pipeline schedule, or a plain loop; no gradient sync until the last) ->
engine.step (reduce, clip at 1.0, AdamW on owned shards, skip if not finite).
MFU = flops_per_token x tokens/s / (world x peak FLOP/s per device) (meter.py: the peak's source, memory).
Read `train` first, the recipe: start -> data -> build -> resume -> loop of train_step; the policies at the
step boundary are named: spike_vote (--on-spike), Saves (when to checkpoint; the preemption vote), roll_back,
meter.MetricsLog (lines and metrics.jsonl), faults.Skips (--max-skipped) and faults.inject_fault (tests).
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

from nanomega.ops import args as flags
from nanomega import checkpoint, data, dist, fused, pp, precision, recompute, rng
from nanomega.ops import faults, health, meter
from nanomega.tools import corpus
from nanomega import reshard, schedules, tp, zero
from nanomega.model import GPT
from nanomega.formulas import model_flops_per_token


def lr_at(step, args):
    """Linear warm-up to --lr over --warmup steps, then cosine decay to --min-lr at --max-steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def load_data(args, world, log):
    """(train, val) windows: prepared shards (--data; or a many-file --corpus, prepared into the cache by
    corpus.py), or the single-file cache of data.prepare (one .txt file: the embedded default)."""
    cache = args.data_cache or os.path.join(args.out_dir, "data")
    files = None if args.data else data.corpus_files(args.corpus)
    if files and len(files) == 1 and files[0].name.endswith((".txt", ".txt.gz")):
        meta = data.prepare(files[0], args.tokenizer, cache)
        return [data.TokenDataset(meta[f"{s}_bin"], meta["dtype"], args.block_size) for s in ("train", "val")]
    index = data.load_index(args.data) if args.data else corpus.cached(
        args.corpus, args.tokenizer, cache, workers=max(1, (os.cpu_count() or 1) // world),
        text_field=args.text_field, progress=log)
    return [data.TokenDataset(data.split_paths(index, s), index["dtype"], args.block_size) for s in ("train", "val")]


def build(args, cfg, grid):
    """The model pieces this rank holds, and the engine that owns their optimizer state."""
    torch.manual_seed(args.seed)
    model = GPT(cfg)  # the same dense init on every rank: each parallel form below slices it
    n_params = sum(p.numel() for p in model.parameters())
    tracker = rng.model_parallel_seed(args.seed, grid)
    if grid.tp.size > 1:
        tp.apply_tensor_parallel(model, grid.tp, args.sequence_parallel, tracker)
    shared = None
    if grid.pp.size > 1:
        pp.build_stage(model, grid, args.virtual_stages)
        shared = pp.tied_embedding(model, grid)
    recompute.apply_recompute(model, args.recompute, args.recompute_layers)
    if args.fused:
        fused.apply_fused(model)
    if args.attention == "fused":  # the eager core with our fused scale-mask-softmax kernel
        for module in model.modules():
            if hasattr(module, "scale_mask_softmax"):
                module.scale_mask_softmax = fused.causal_softmax
    precision.cast_model(model, precision.parse_dtype(args.dtype))
    model.to(grid.device)
    if args.compile:  # per block, as torchtitan: small graphs compile fast; names and hooks of the module stay
        for block in model.blocks.values():
            block.compile()
    engine = zero.ZeroEngine(model, torch.optim.AdamW, zero.weight_decay_groups(args.weight_decay, betas=(0.9, 0.95)),
                             grid, args.zero, shared=shared)
    return model, engine, n_params


def forward_backward(model, engine, grid, batches, args, *, loss_scale=1.0, trace=None):
    """Mean loss over this rank's micro-batches; gradients (x loss_scale) left in the engine's buffers."""
    if grid.pp.size > 1:
        return pp.train_step(model, grid, batches, schedule=args.schedule, no_sync=engine.no_sync,
                             loss_scale=loss_scale, virtual=args.virtual_stages,
                             act_shape=activation_shape(args, grid), trace=trace)
    total = torch.zeros((), dtype=torch.float64, device=grid.device)  # summed on the device: no sync per micro-batch
    for i, (x, y) in enumerate(batches):
        with engine.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
            loss = model(x, y)
            (loss * (loss_scale / len(batches))).backward()
        total += loss.detach().double() / len(batches)
    return total


def to_device(tensors, device):
    """A host batch on the device: on CUDA through pinned memory, non-blocking (the copy overlaps compute)."""
    if device.type != "cuda":
        return tuple(t.to(device) for t in tensors)
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)


def activation_shape(args, grid):
    """What flows between pipeline stages: (b, s, h), or (b, s/tp, h) with sequence parallelism."""
    s = args.block_size // grid.tp.size if args.sequence_parallel else args.block_size
    return (args.batch_size, s, args.n_embd)


@torch.no_grad()
def evaluate(model, grid, val_set, args):
    """Mean loss over fixed validation windows: --eval-iters global batches, the same for every layout and
    every call (so curves compare), split over dp ranks like training batches."""
    model.eval()
    n = min(len(val_set), args.eval_iters * args.batch_size * args.grad_accum * grid.dp.size)
    idx = torch.randperm(len(val_set), generator=torch.Generator().manual_seed(args.seed))[:n].numpy()
    mine = idx[grid.dp_rank * n // grid.dp.size:(grid.dp_rank + 1) * n // grid.dp.size]
    batches = [to_device(val_set.get(mine[i:i + args.batch_size]), grid.device)
               for i in range(0, len(mine), args.batch_size)]
    if grid.pp.size > 1:
        loss = pp.forward_only(model, grid, batches, activation_shape(args, grid), virtual=args.virtual_stages)
    else:
        loss = sum(model(x, y).double() for x, y in batches) / len(batches)  # one sync, below
    model.train()
    loss = torch.as_tensor(loss, dtype=torch.float32, device=grid.device).reshape(1)
    return grid.dp.all_reduce(loss).item() / grid.dp.size


def rank_state(engine, sampler, scaler, step, grid, spikes=None, copy=True):
    """What this rank writes: its pieces of every parameter by name (any layout can load them), data position,
    loss scale, RNG (this device's), the lr scale and skipped data windows of rollbacks. copy=False: views of
    the live tensors, for AsyncSaver, which copies them once into its reused buffers."""
    return dict(universal=reshard.pieces(engine, grid, copy), spikes=spikes and spikes.state_dict(),
                sampler=sampler.state_dict(), scaler=scaler.state_dict(), step=step, **rng.save_state(grid.device))


def main(argv=None):
    args = flags.get_args(argv)
    with faults.job(args):  # preemption signals, the out-dir lock, no orphans (nanomega/ops/faults.py)
        return train(args)


def train(args):
    """The recipe: check the flags, set up (grid, data, model, engine), resume, loop. Returns the last row."""
    cfg, dp = flags.check(args)  # every check that needs no collective, before the first one
    grid = start(args, cfg, dp)
    log = grid.rank == grid.world - 1  # the last rank: last pipeline stage, where the loss lives
    train_set, val_set = load_data(args, grid.world, log)
    global_batch = args.batch_size * args.grad_accum * dp
    sampler = data.Sampler(len(train_set), global_batch, args.seed)
    model, engine, n_params = build(args, cfg, grid)
    scaler = precision.LossScaler.for_dtype(precision.parse_dtype(args.dtype))
    spikes = faults.Spikes(args)
    layout = dict(dp=dp, tp=args.tp, pp=args.pp, zero=args.zero, dtype=args.dtype, tokenizer=args.tokenizer,
                  virtual_stages=args.virtual_stages, sequence_parallel=args.sequence_parallel)
    step = resume(args, cfg, grid, layout, engine=engine, scaler=scaler, spikes=spikes, sampler=sampler, log=log)

    peak, source = announce(args, cfg, grid, n_params=n_params, global_batch=global_batch, log=log)
    metrics = meter.MetricsLog(args.out_dir, step, enabled=log, device=grid.device, world=grid.world,
                               flops_per_token=model_flops_per_token(cfg), peak=peak, source=source,
                               tokens_per_step=global_batch * args.block_size,
                               log_every=args.log_every)
    skips, watchdog = faults.Skips(args.max_skipped), faults.Watchdog(args, grid)
    saves = Saves(args, cfg, grid, layout)
    faults.arm_preemption()  # from here on SIGTERM/SIGUSR1 checkpoint at the next step boundary
    if args.eval_every and step == 0:  # the starting point of the validation curve (~ ln V)
        metrics.log_validation(evaluate(model, grid, val_set, args))
    rec = {}
    while step < args.max_steps:
        rec, spike = train_step(step, args=args, model=model, engine=engine, grid=grid, sampler=sampler,
                                train_set=train_set, scaler=scaler, spikes=spikes, watchdog=watchdog, metrics=metrics)
        step = rec["step"]
        if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
            with watchdog.paused():
                rec["val_loss"] = evaluate(model, grid, val_set, args)
        metrics.log_step(rec, spike=spike)
        skips.update(not rec["skipped"], step)  # "skipped" is the same on every rank (a reduced norm)
        if spike and args.on_spike == "rollback":
            step = roll_back(args, cfg, grid, layout, engine=engine, scaler=scaler, spikes=spikes, step=step)
            metrics.reopen(step)  # the rows since that checkpoint are redone
            continue
        state = functools.partial(rank_state, engine, sampler, scaler, step, grid, spikes)  # built only to save
        if saves.at_step_end(step, state=state, may_save=skips.may_save(), watchdog=watchdog):
            break  # preempted: checkpointed at this step boundary on every rank
    saves.close()
    metrics.close()
    return rec


def start(args, cfg, dp):
    """torch.distributed, the device's matmul mode, the rank grid, and --health-check before anything else."""
    device = dist.init(args.device, args.collective_timeout)
    precision.set_tf32(device, args.tf32)
    grid = dist.Grid(dp, args.pp, args.tp)
    if args.health_check:
        health.gate(grid)
    if grid.rank == grid.world - 1 and args.model:
        print(f"--model {args.model}: n_layer {cfg.n_layer}, n_head {cfg.n_head}, n_embd {cfg.n_embd}, block_size "
              f"{cfg.block_size} (nanomega/ops/presets.py; explicit shape flags override it)")
    return grid


def resume(args, cfg, grid, layout, *, engine, scaler, spikes, sampler, log):
    """The step to start from: 0, or that of the checkpoint flags.check chose (--resume), loaded into this rank."""
    if not args.resume_folder:
        return 0
    state = restore(args.resume_folder, cfg, grid, layout, engine=engine, scaler=scaler, spikes=spikes, sampler=sampler)
    if log:
        print(f"resumed from {args.resume_folder} at step {state['step']}"
              + ("" if state.get("same_layout") else " (resharded)"))
    return state["step"]


def announce(args, cfg, grid, *, n_params, global_batch, log):
    """The MFU peak (meter.py) and the start-up lines: the logging rank measures (the others would compete for
    the same cores); the others report a peak of 1."""
    if not log:
        return 1.0, ""
    dtype = precision.parse_dtype(args.dtype)
    peak, source = meter.peak_flops(grid.device, dtype, args.tf32, args.peak_flops)
    warning = meter.emulation_warning(grid.device, dtype)
    if warning:
        print(warning, file=sys.stderr)
    if args.tp > 1:
        print(f"vocab padded from {cfg.vocab_size} to {cfg.padded_vocab_size} (a multiple of 128 x tp)")
    print(f"{grid}\nmodel: {n_params / 1e6:.2f}M parameters, {model_flops_per_token(cfg) / 1e6:.1f} MFLOP/token; "
          f"global batch {global_batch} x {args.block_size} tokens; attention {args.attention}; "
          f"peak {peak / 1e9:,.0f} GFLOP/s per rank ({source})")
    os.makedirs(args.out_dir, exist_ok=True)
    return peak, source


def train_step(step, *, args, model, engine, grid, sampler, train_set, scaler, spikes, watchdog, metrics):
    """One optimizer step: lr(step) -> this dp rank's micro-batches -> forward/backward -> the loss agreed over
    dp (the step's one device sync) -> the spike decision -> engine.step. Returns (metrics row, spike)."""
    t0 = time.perf_counter()
    watchdog.beat(step + 1, "start")
    lr = lr_at(step, args) * spikes.lr_scale
    engine.set_lr(lr)
    micro = sampler.local_micro_batches(sampler.step, grid.dp_rank, grid.dp.size, args.batch_size, args.grad_accum)
    batches = [to_device(train_set.get(idx), grid.device) for idx in micro]
    fault = faults.inject_fault(args.inject_fault, rank=grid.rank, data_step=sampler.step + 1, step=step + 1)
    trace = schedules.Trace(grid.pp_rank) if grid.pp.size > 1 and step == min(1, args.max_steps - 1) else None
    with faults.poisoned(model) if fault == "nan" else contextlib.nullcontext():  # this rank's loss becomes NaN
        loss = forward_backward(model, engine, grid, batches, args, loss_scale=scaler.scale, trace=trace)
    if trace and grid.dp_rank == 0 and grid.tp_rank == 0:  # step 1's pipeline timeline, for nanomega.tools.plot
        save_trace(trace, args.out_dir)
    watchdog.beat(step + 1, "backward done")
    loss = torch.as_tensor(loss, dtype=torch.float32, device=grid.device).reshape(1)
    if fault == "spike":  # the logged loss x 10 (the gradients are the step's own)
        loss = loss * 10
    loss = grid.dp.all_reduce(loss).item() / grid.dp.size  # the step's one device sync
    spike = spike_vote(grid, spikes.check(loss), policy=args.on_spike)
    info = engine.step(clip_norm=args.grad_clip or None, scaler=scaler, skip=spike and args.on_spike == "skip")
    sampler.advance()
    step += 1
    if args.on_nan == "stop" and not (info["stepped"] and math.isfinite(loss)):
        raise FloatingPointError(f"step {step}: loss {loss} / grad norm {info['grad_norm']} not finite; "
                                 f"stopping (--on-nan stop); the last checkpoint is untouched")
    rec = metrics.row(step=step, loss=loss, lr=lr, grad_norm=info["grad_norm"], skipped=not info["stepped"],
                      seconds=time.perf_counter() - t0)
    return rec, spike


def spike_vote(grid, spike, *, policy):
    """The loss lives on the last pipeline stage: unless --on-spike warn, every rank takes its decision."""
    return grid_agrees(grid, spike) if policy != "warn" else spike


class Saves:
    """When to checkpoint, decided alike on every rank: every --save-every steps and at the last; after
    --save-every-minutes (a vote: clocks differ, and a save that only some ranks start hangs); when preempted
    (a vote: every rank stops at the same step); never right after a skipped step (the next finite step saves)."""

    def __init__(self, args, cfg, grid, layout):
        self.args, self.cfg, self.grid, self.layout = args, cfg, grid, layout
        self.saver = checkpoint.AsyncSaver(args.out_dir, cfg, grid, layout) if args.async_save else None
        self.last, self.pending = time.time(), False

    def at_step_end(self, step, *, state, may_save, watchdog):
        """Save if due (state() builds this rank's checkpoint state); True when preempted: the loop ends."""
        args, grid = self.args, self.grid
        due = (args.save_every and step % args.save_every == 0) or step == args.max_steps
        if args.save_every_minutes:  # clocks differ: every rank must take the same decision, or the save hangs
            due = grid_agrees(grid, due or time.time() - self.last >= 60 * args.save_every_minutes)
        preempted = grid_agrees(grid, faults.preempt_requested())  # every rank stops at the same step
        if self.saver:  # the manifest of a background save, once every rank has written its shard
            self.saver.poll(lambda busy: grid_agrees(grid, busy))
        if (due or preempted or self.pending) and not may_save:
            if due or preempted:
                faults.say(f"step {step}: checkpoint not written (the step was skipped); the next finite step saves")
            self.pending = True
        elif due or preempted or self.pending:
            self.save(step, state(copy=self.saver is None), watchdog=watchdog)  # async: views, copied once
        if preempted:
            faults.say(f"step {step}: preempted (signal); exiting 0 after the last checkpoint; --resume continues")
        return preempted

    def save(self, step, state, *, watchdog):
        """Write (or start writing, --async-save) this rank's shard; then --keep-last (faults.saved)."""
        with watchdog.paused():
            if self.saver:
                self.saver.start(step, state)
            else:
                checkpoint.save(self.args.out_dir, step, self.cfg, state, self.grid, self.layout)
        faults.saved(self.args, self.args.resume_folder, self.grid)
        self.last, self.pending = time.time(), False

    def close(self):
        """Wait for a background save (collective: its manifest)."""
        if self.saver:
            self.saver.wait()


def save_trace(trace, out_dir):
    """One pipeline rank's op spans (perf_counter: one clock for the processes of a host) as JSON."""
    folder = os.path.join(out_dir, "pipeline_trace")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank_{trace.rank:03d}.json"), "w") as f:
        json.dump(dict(rank=trace.rank, events=[e._asdict() for e in trace.events]), f)


def restore(folder, cfg, grid, layout, *, engine, scaler, spikes, sampler=None):
    """Load a checkpoint into this rank's engine, loss scaler, RNG (same layout) and, if given, sampler."""
    state = reshard.load(folder, cfg, engine, grid, layout)
    fresh = state["sampler"] is None  # a step-0 import (nanomega.tools.hf): the data and the loss scale start fresh
    if sampler is not None and not fresh:
        sampler.load_state_dict(state["sampler"])
    if not fresh:
        scaler.load_state_dict(state["scaler"])
    spikes.load_state_dict(state.get("spikes"))
    if state.get("same_layout"):  # the RNG streams (CPU and CUDA) continue exactly; a new layout reseeds them
        rng.restore_state(state, grid.device)
    return state


def roll_back(args, cfg, grid, layout, *, engine, scaler, spikes, step):
    """--on-spike rollback: reload the newest verified checkpoint, but not the sampler's position (the data
    since that checkpoint is skipped); returns the step to continue from."""
    folder, _ = checkpoint.find_resume(args.out_dir, cfg)
    if folder is None:
        raise FloatingPointError(f"step {step}: loss spike and no checkpoint to roll back to; use --save-every")
    state = restore(folder, cfg, grid, layout, engine=engine, scaler=scaler, spikes=spikes)
    spikes.rolled_back(state["step"], step)
    return state["step"]


def grid_agrees(grid, flag):
    """True on every rank if any rank says so (a 1-element all-reduce over the whole grid)."""
    t = torch.tensor([float(flag)], device=grid.device)
    for axis in (grid.tp, grid.pp, grid.dp):
        axis.all_reduce(t)
    return bool(t.item() > 0)


if __name__ == "__main__":
    faults.entrypoint(main)  # expected failures: one line, recorded for torchrun's summary
