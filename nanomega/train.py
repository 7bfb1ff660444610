"""Train a GPT under any tp x pp x dp x ZeRO layout: the one composer.

    python nanomega/train.py                                      # one process
    torchrun --nproc_per_node=4 nanomega/train.py --tp 2 --pp 2   # dp = world / (tp * pp) = 1

Composition order (build): grid -> dense model (same seed everywhere) -> tensor parallel -> pipeline stage
-> recompute -> fused kernels -> precision -> ZeRO/DP engine. One step: lr(step) -> this dp rank's
micro-batches -> forward/backward (pipeline schedule, or a plain loop; no gradient sync until the last) ->
engine.step (reduce, clip at 1.0, AdamW on owned shards, skip if not finite).
MFU = flops_per_token x tokens/s / (world x peak FLOP/s per device) (meter.py: the peak's source, memory).
Lessons: lessons/01-dense-model.md (the loop), lessons/09-3d-parallelism.md (the composition).
"""
import contextlib
import json
import math
import os
import signal
import sys
import time

import torch

if __package__ in (None, ""):  # `python nanomega/train.py`: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanomega import args as flags
from nanomega import checkpoint, corpus, data, dist, faults, fused, health, meter, pp, precision, recompute, rng
from nanomega import reshard, schedules, tp, zero
from nanomega.model import GPT, flops_per_token


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
    files = None if args.data else corpus.corpus_files(args.corpus)
    if files and len(files) == 1 and files[0].name.endswith((".txt", ".txt.gz")):
        meta = data.prepare(files[0], args.tokenizer, cache)
        return [data.TokenDataset(meta[f"{s}_bin"], meta["dtype"], args.block_size) for s in ("train", "val")]
    index = corpus.load_index(args.data) if args.data else corpus.cached(
        args.corpus, args.tokenizer, cache, workers=max(1, (os.cpu_count() or 1) // world),
        text_field=args.text_field, progress=log)
    return [data.TokenDataset(corpus.split_paths(index, s), index["dtype"], args.block_size) for s in ("train", "val")]


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


def forward_backward(model, engine, grid, batches, args, loss_scale, trace=None):
    """Mean loss over this rank's micro-batches; gradients left in the engine's buffers."""
    if grid.pp.size > 1:
        return pp.train_step(model, grid, batches, args.schedule, engine.no_sync, loss_scale,
                             args.virtual_stages, activation_shape(args, grid), trace=trace)
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


def rank_state(engine, sampler, scaler, step, grid, spikes=None):
    """What this rank writes: its pieces of every parameter by name (any layout can load them), data position,
    loss scale, RNG (this device's), the lr scale and skipped data windows of rollbacks."""
    return dict(universal=reshard.universal_pieces(engine, grid), spikes=spikes and spikes.state_dict(),
                sampler=sampler.state_dict(), scaler=scaler.state_dict(), step=step, **rng.save_state(grid.device))


def main(argv=None):
    args = flags.get_args(argv)
    with faults.job(args):  # preemption signals, the out-dir lock, no orphans (nanomega/faults.py)
        return train(args)


def train(args):
    cfg, dp = flags.check(args)  # every check that needs no collective, before the first one
    device = dist.init(args.device, args.collective_timeout)
    precision.set_tf32(device, args.tf32)
    grid = dist.Grid(dp, args.pp, args.tp)
    if args.health_check:
        health.gate(grid)
    log = grid.rank == grid.world - 1  # the last rank: last pipeline stage, where the loss lives
    if log and args.model:
        print(f"--model {args.model}: n_layer {cfg.n_layer}, n_head {cfg.n_head}, n_embd {cfg.n_embd}, block_size "
              f"{cfg.block_size} (nanomega/presets.py; explicit shape flags override it)")

    train_set, val_set = load_data(args, grid.world, log)
    global_batch = args.batch_size * args.grad_accum * dp
    sampler = data.Sampler(len(train_set), global_batch, args.seed)
    model, engine, n_params = build(args, cfg, grid)
    scaler = precision.LossScaler(dynamic=args.dtype == "fp16")

    layout = dict(dp=dp, tp=args.tp, pp=args.pp, zero=args.zero, dtype=args.dtype, tokenizer=args.tokenizer,
                  virtual_stages=args.virtual_stages, sequence_parallel=args.sequence_parallel)
    step, folder, spikes = 0, args.resume_folder, faults.Spikes(args)  # folder: verified by flags.check
    if folder:
        state = restore(folder, cfg, engine, grid, layout, scaler, spikes, sampler)
        step = state["step"]
        if log:
            print(f"resumed from {folder} at step {step}" + ("" if state.get("same_layout") else " (resharded)"))

    dtype = precision.parse_dtype(args.dtype)
    peak, source, flops_tok = 1.0, "", flops_per_token(cfg)
    if log:  # only the logging rank measures (the others would compete for the same cores)
        peak, source = meter.peak_flops(device, dtype, args.tf32, args.peak_flops)
        warning = meter.emulation_warning(device, dtype)
        if warning:
            print(warning, file=sys.stderr)
        if args.tp > 1:
            print(f"vocab padded from {cfg.vocab_size} to {cfg.padded_vocab_size} (a multiple of 128 x tp)")
        print(f"{grid}\nmodel: {n_params / 1e6:.2f}M parameters, {flops_tok / 1e6:.1f} MFLOP/token; "
              f"global batch {global_batch} x {args.block_size} tokens; attention {args.attention}; "
              f"peak {peak / 1e9:,.0f} GFLOP/s per rank ({source})")
        os.makedirs(args.out_dir, exist_ok=True)
    meter.reset_peak_memory(device)
    mfu_warned = False
    metrics = faults.open_metrics(args.out_dir, step) if log else None  # rows after `step` are redone
    skips, watchdog = faults.Skips(args.max_skipped), faults.Watchdog(args, grid)
    saver = checkpoint.AsyncSaver(args.out_dir, cfg, grid, layout) if args.async_save else None
    faults.arm_preemption()  # from here on SIGTERM/SIGUSR1 checkpoint at the next step boundary
    last_save, rec, pending_save = time.time(), {}, False
    if args.eval_every and step == 0:  # the starting point of the validation curve (~ ln V)
        val = evaluate(model, grid, val_set, args)
        if log:
            print(f"step     0 val {val:.4f}", flush=True)
            metrics.write(json.dumps(dict(step=0, val_loss=val, mfu=0.0, peak_flops=peak,
                                          mem_gib=meter.peak_memory_gib(device))) + "\n")
    while step < args.max_steps:
        t0 = time.perf_counter()
        watchdog.beat(step + 1, "start")
        lr = lr_at(step, args) * spikes.lr_scale
        engine.set_lr(lr)
        micro = sampler.local_micro_batches(sampler.step, grid.dp_rank, dp, args.batch_size, args.grad_accum)
        batches = [to_device(train_set.get(idx), device) for idx in micro]
        fault = args.inject_fault and args.inject_fault[1:] == (grid.rank, sampler.step + 1) and args.inject_fault[0]
        if fault == "raise":
            raise RuntimeError(f"--inject-fault: rank {grid.rank} raises at step {step + 1}")
        if fault in ("sigterm", "hang"):  # a preemption notice arriving mid-step; a rank frozen (SIGSTOP)
            os.kill(os.getpid(), signal.SIGTERM if fault == "sigterm" else signal.SIGSTOP)
        trace = schedules.Trace(grid.pp_rank) if grid.pp.size > 1 and step == min(1, args.max_steps - 1) else None
        loss_scale = float("nan") if fault == "nan" else scaler.scale  # an injected NaN poisons the gradients
        loss = forward_backward(model, engine, grid, batches, args, loss_scale, trace)
        if trace and grid.dp_rank == 0 and grid.tp_rank == 0:  # step 1's pipeline timeline, for nanomega.plot
            save_trace(trace, args.out_dir)
        watchdog.beat(step + 1, "backward done")
        loss = torch.as_tensor(loss, dtype=torch.float32, device=device).reshape(1) * (10 if fault == "spike" else 1)
        loss = grid.dp.all_reduce(loss).item() / dp  # the step's one device sync
        spike = spikes.check(loss)  # the loss lives on the last pipeline stage: everyone takes its decision
        spike = grid_agrees(grid, spike) if args.on_spike != "warn" else spike
        info = engine.step(clip_norm=args.grad_clip or None, scaler=scaler, skip=spike and args.on_spike == "skip")
        sampler.advance()
        step += 1
        finite = info["stepped"] and math.isfinite(loss)
        if not finite and args.on_nan == "stop":
            raise FloatingPointError(f"step {step}: loss {loss} / grad norm {info['grad_norm']} not finite; "
                                     f"stopping (--on-nan stop); the last checkpoint is untouched")
        dt = time.perf_counter() - t0
        tok_s = global_batch * args.block_size / dt
        rec = dict(step=step, loss=loss, lr=lr, grad_norm=info["grad_norm"], skipped=not info["stepped"],
                   tok_s=tok_s, mfu=meter.mfu(flops_tok, tok_s, grid.world, peak), peak_flops=peak,
                   mem_gib=meter.peak_memory_gib(device))
        rec["tokens"] = step * global_batch * args.block_size  # the x axis of nanomega.plot's loss-vs-tokens
        if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
            with watchdog.paused():
                rec["val_loss"] = evaluate(model, grid, val_set, args)
        if log:
            if rec["mfu"] > 1 and not mfu_warned:
                mfu_warned = True
                print(f"warning: MFU {rec['mfu']:.2f} > 1 is impossible: the peak {peak / 1e9:,.0f} GFLOP/s "
                      f"({source}) is wrong; pass the device's real peak with --peak-flops", file=sys.stderr)
            if step % args.log_every == 0 or "val_loss" in rec or spike or not finite:
                val = f" val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
                note = " SKIPPED" + (" (loss spike)" if spike else " (not finite)") if not info["stepped"] else (
                    " LOSS SPIKE" if spike else "")
                print(f"step {step:5d} loss {loss:.4f}{val} lr {lr:.2e} norm {info['grad_norm']:.3f} "
                      f"{tok_s:,.0f} tok/s mfu {100 * rec['mfu']:.1f}% mem {rec['mem_gib']:.2f} GiB{note}",
                      flush=True)
                meter.reset_peak_memory(device)  # the next line reports its own interval's peak
            metrics.write(json.dumps(rec) + "\n")
            metrics.flush()
        skips.update(info["stepped"], step)  # info["stepped"] is the same on every rank (a reduced norm)
        if spike and args.on_spike == "rollback":
            step = roll_back(args, cfg, engine, grid, layout, scaler, spikes, step)
            if log:  # the rows since that checkpoint are redone
                metrics.close()
                metrics = faults.open_metrics(args.out_dir, step)
            continue
        due = (args.save_every and step % args.save_every == 0) or step == args.max_steps
        if args.save_every_minutes:  # clocks differ: every rank must take the same decision, or the save hangs
            due = grid_agrees(grid, due or time.time() - last_save >= 60 * args.save_every_minutes)
        preempted = grid_agrees(grid, faults.preempt_requested())  # every rank stops at the same step
        if saver:  # the manifest of a background save, once every rank has written its shard
            saver.poll(lambda busy: grid_agrees(grid, busy))
        if (due or preempted or pending_save) and not skips.may_save():
            if due or preempted:
                faults.say(f"step {step}: checkpoint not written (the step was skipped); the next finite step saves")
            pending_save = True
        elif due or preempted or pending_save:
            state = rank_state(engine, sampler, scaler, step, grid, spikes)
            with watchdog.paused():
                if saver:
                    saver.start(step, state)
                else:
                    checkpoint.save(args.out_dir, step, cfg, state, grid, layout)
            faults.saved(args, folder, grid)
            last_save, pending_save = time.time(), False
        if preempted:
            faults.say(f"step {step}: preempted (signal); exiting 0 after the last checkpoint; --resume continues")
            break
    if saver:
        saver.wait()
    if metrics:
        metrics.close()
    return rec


def save_trace(trace, out_dir):
    """One pipeline rank's op spans (perf_counter: one clock for the processes of a host) as JSON."""
    folder = os.path.join(out_dir, "pipeline_trace")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank_{trace.rank:03d}.json"), "w") as f:
        json.dump(dict(rank=trace.rank, events=[e._asdict() for e in trace.events]), f)


def restore(folder, cfg, engine, grid, layout, scaler, spikes, sampler=None):
    """Load a checkpoint into this rank's engine, loss scaler, RNG (same layout) and, if given, sampler."""
    state = reshard.load(folder, cfg, engine, grid, layout)
    fresh = state["sampler"] is None  # a step-0 import (nanomega.hf): the data and the loss scale start fresh
    if sampler is not None and not fresh:
        sampler.load_state_dict(state["sampler"])
    if not fresh:
        scaler.load_state_dict(state["scaler"])
    spikes.load_state_dict(state.get("spikes"))
    if state.get("same_layout"):  # the RNG streams (CPU and CUDA) continue exactly; a new layout reseeds them
        rng.restore_state(state, grid.device)
    return state


def roll_back(args, cfg, engine, grid, layout, scaler, spikes, step):
    """--on-spike rollback: reload the newest verified checkpoint, but not the sampler's position (the data
    since that checkpoint is skipped); returns the step to continue from."""
    folder, _ = checkpoint.find_resume(args.out_dir, cfg)
    if folder is None:
        raise FloatingPointError(f"step {step}: loss spike and no checkpoint to roll back to; use --save-every")
    state = restore(folder, cfg, engine, grid, layout, scaler, spikes)
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
