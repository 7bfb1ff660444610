"""Checkpoints in the training loop: when to save (Saves), what a rank saves (rank_state), and
loading it back (restore: for --resume and for --on-spike rollback).

A checkpoint is only worth its cost if every rank writes the same step and a resume continues
exactly: the decision to save is taken alike on every rank (a vote where clocks or signals differ),
never right after a skipped step, and the state holds everything a step depends on (this rank's
pieces by name, the data position, the loss scale, the RNG streams, the spike policy's lr scale).
Lessons: lessons/19-checkpoints-and-failures.md, lessons/20-when-training-breaks.md
"""

import time

from nanomega import async_checkpoint, checkpoint, flash, fp8_linear, moe, reshard, rng
from nanomega.job import faults, lifecycle


def layout(config, tokenizer_sha256):
    """What a checkpoint records of the job's layout (manifest["layout"]): a resume under the same
    one loads each rank's own shard and continues its RNG streams; under another one it reshards
    (reshard.py)."""
    return dict(
        dp=config.dp,
        tp=config.tp,
        pp=config.pp,
        ep=config.ep,
        zero=config.zero,
        dtype=config.dtype,
        tokenizer=config.tokenizer,
        tokenizer_sha256=tokenizer_sha256,
        virtual_stages=config.virtual_stages,
        sequence_parallel=config.sequence_parallel,
        **({"cp": config.cp} if config.cp > 1 else {}),
        **({"dp_shard": config.dp_shard} if config.dp_shard not in (0, config.dp) else {}),
        **faults.arithmetic(config),  # what a resume compares (faults.RESUME_CHECKS)
    )


def rank_state(engine, sampler, scaler, step, grid, spikes=None, copy=True):
    """What this rank writes: its pieces of every parameter by name (any layout can load them), data
    position, loss scale, RNG (this device's), the lr scale and skipped data windows of rollbacks,
    and (MoE) every layer's routing bias (a buffer, not a parameter: collective over pp,
    moe.bias_table), (--fp8 delayed) every weight's amax history (collective over pp too).
    copy=False: views of the live tensors, for AsyncSaver, which copies them once into its reused
    buffers."""
    return dict(
        universal=reshard.pieces(engine, grid, copy),
        spikes=spikes and spikes.state_dict(),
        moe_bias=moe.bias_table(engine.module, grid),
        fp8_histories=fp8_linear.histories(engine.module, grid),
        sampler=sampler.state_dict(),
        scaler=scaler.state_dict(),
        step=step,
        **rng.save_state(grid.device),
    )


class Saves:
    """When to checkpoint, decided alike on every rank: every --save-every steps and at the last;
    after --save-every-minutes (a vote: clocks differ, and a save that only some ranks start hangs);
    when preempted (a vote: every rank stops at the same step); never right after a skipped step
    (the next finite step saves)."""

    def __init__(
        self,
        out_dir,
        cfg,
        grid,
        layout,
        *,
        every,
        every_minutes,
        max_steps,
        async_save,
        keep_last,
        resumed_from,
        copies=None,
    ):
        self.out_dir, self.cfg, self.grid, self.layout = out_dir, cfg, grid, layout
        self.every, self.every_minutes, self.max_steps = every, every_minutes, max_steps
        self.keep_last, self.resumed_from = keep_last, resumed_from

        # --flash-restore: a flash.Copies; each shard is also copied to shared memory
        self.copies = copies
        # by the writer thread (async) or this one, before the manifest
        self.keep = copies.keep if copies else None

        self.saver = (
            async_checkpoint.AsyncSaver(out_dir, cfg, grid, layout, self.keep)
            if async_save
            else None
        )
        self.last, self.pending = time.time(), False

    def at_step_end(self, step, *, state, may_save, guard):
        """Save if due (state() builds this rank's checkpoint state); True when preempted: the loop
        ends."""
        due = (self.every and step % self.every == 0) or step == self.max_steps
        # clocks differ
        late = bool(self.every_minutes) and time.time() - self.last >= 60 * self.every_minutes
        busy = (
            self.saver is not None and self.saver.shard is not None and not self.saver.shard.done()
        )

        # one vote, one host sync: save (any rank's clock says so), stop (a preemption signal), a
        # shard still being written (the manifest waits), non-finite weights after the update --
        # every rank must take each decision alike, or the next step hangs
        due, preempted, busy, broken = lifecycle.grid_votes(
            self.grid, due or late, lifecycle.preempt_requested(), busy, guard.vote()
        )

        guard.weights_voted(broken)  # stops before any save
        if self.saver:  # the manifest of a background save, once every rank has written its shard
            self.saver.poll(lambda _: busy)
        if self.copies:  # the copy of an older checkpoint goes once a newer one is complete
            self.copies.prune()

        # save now, or at the next finite step
        if (due or preempted or self.pending) and not may_save:
            if due or preempted:
                faults.say(
                    f"step {step}: checkpoint not written (the step was skipped); the next finite step saves"
                )
            self.pending = True
        elif due or preempted or self.pending:
            # async: views, copied once
            self.save(step, state(copy=self.saver is None), guard=guard)

        if preempted:
            faults.say(
                f"step {step}: preempted (signal); exiting 0 after the last checkpoint; --resume continues"
            )
        return preempted

    def save(self, step, state, *, guard):
        """Write (or start writing, --async-save) this rank's shard; then --keep-last
        (faults.saved)."""
        # the watchdog counts the shard's writes: a save may outlast a step
        with guard.saving(step) as wrap:
            if self.saver:
                self.saver.start(step, state, wrap)
            else:
                checkpoint.save(
                    self.out_dir, step, self.cfg, state, self.grid, self.layout, wrap, self.keep
                )
                if self.copies:
                    self.copies.prune()
            faults.saved(self.out_dir, self.keep_last, self.resumed_from, self.grid, step)
        self.last, self.pending = time.time(), False

    def close(self, guard, step):
        """Wait for a background save (collective: its manifest), its writes beating."""
        if self.saver:
            with guard.saving(step):
                self.saver.wait()
            if self.copies:
                self.copies.prune()

    def roll_back(self, guard, step, *, engine, scaler, spikes):
        """--on-spike rollback (roll_back below), once a background save is complete: rank 0
        writes its manifest in the background, so before that every rank could see another
        newest checkpoint."""
        self.close(guard, step)
        return roll_back(
            self.out_dir,
            self.cfg,
            self.grid,
            self.layout,
            engine=engine,
            scaler=scaler,
            spikes=spikes,
            step=step,
            copies=self.copies,
        )


def restore(folder, cfg, grid, layout, *, engine, scaler, spikes, sampler=None, copies=None):
    """Load a checkpoint into this rank's engine, loss scaler, RNG (same layout) and, if given,
    sampler. copies: a flash.Copies (--flash-restore): this rank's own shard read from shared memory
    when its copy holds the same bytes (state["copies"] names it), else from the disk."""
    state = reshard.load(folder, cfg, engine, grid, layout, copies.find if copies else None)
    # a step-0 import (nanomega.tools.hf): the data and the loss scale start fresh
    fresh = state["sampler"] is None
    if sampler is not None and not fresh:
        sampler.load_state_dict(state["sampler"])
    if not fresh:
        scaler.load_state_dict(state["scaler"])
    spikes.load_state_dict(state.get("spikes"))
    # the same table in every shard: any layout
    moe.load_bias_table(engine.module, state.get("moe_bias"))
    fp8_linear.load_histories(engine.module, state.get("fp8_histories"))
    # the RNG streams (CPU and CUDA) continue exactly; a new layout reseeds them
    if state.get("same_layout"):
        rng.restore_state(state, grid.device)
    return state


def roll_back(out_dir, cfg, grid, layout, *, engine, scaler, spikes, step, copies=None):
    """--on-spike rollback: reload the newest verified checkpoint, but not the sampler's position
    (the data since that checkpoint is skipped); returns the step to continue from. Every rank is
    here (after a vote): with --flash-restore the fast discovery's vote (flash.look, flash.agree)
    may spare the full one, and each rank reloads its own shard from its copy."""
    found = flash.look(out_dir, cfg, copies, layout, grid.world)[0] if copies else None
    # every rank votes
    fast = copies is not None and flash.agree(found, cfg, grid, engine)[0] == grid.world
    folder = found.folder if fast else checkpoint.find_resume(out_dir, cfg)[0]
    if folder is None:
        raise FloatingPointError(
            f"step {step}: loss spike and no checkpoint to roll back to; use --save-every"
        )
    state = restore(
        folder, cfg, grid, layout, engine=engine, scaler=scaler, spikes=spikes, copies=copies
    )
    spikes.rolled_back(state["step"], step)
    return state["step"]
