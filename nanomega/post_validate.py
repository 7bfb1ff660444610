"""Post-validation (Qi et al. 2024, sec. 4): the optimizer step without the pipeline's barrier.

The step needs two global values: the gradient norm (clipping) and the loss (the spike guard), both
summed over the pipeline's stages, i.e. known only once the last stage has finished. ZB-H2's ranks
finish T_F apart, so a step that waits for them idles (p - 1) max(T_F, T_F + T_B - 2 T_W) where the
paper's row says (p - 1)(T_F + T_B - 2 T_W). Here every rank steps at once, as if nothing were to
be clipped or skipped, while the pipeline's reductions are in flight (Axis.start, Axis.broadcast
without waiting); then it waits for them and validates the step it took. When the global norm
clips, or the step must be skipped (a non-finite norm under loss scaling, a loss spike), it rolls
back to the kept copy and redoes the step with the global value: the synchronized step's
arithmetic, so its result bitwise (tests/test_post_validate.py).
    optimistic  kept = (fp32 masters, optimizer state); clip coefficient 1; step; write back
    validate    norm = sqrt(sum over pp of this stage's share); redo = clip(norm) < 1 or skipped
    rollback    masters, state <- kept; clip_(norm); step (unless skipped); write back
Cost: one copy of the masters and the optimizer state (12 bytes per parameter with AdamW) and, on a
rollback, a second step. The timing model (chained, below): steps run back to back without the
barrier, each rank's period is its own span, m (T_F + T_B + T_W) + (p - 1)(T_F + T_B - 2 T_W).
Lesson: lessons/08-pipeline-parallel.md
"""

import math

import torch

from . import clip
from .schedules import Op

# this process's steps and rollbacks (tests/test_post_validate.py reads them)
COUNTS = {"steps": 0, "rolled_back": 0}


def error(pp, optimizer, offload, zeropp):
    """Why --post-validate cannot run with these flags (one line), or None."""
    if pp < 2:
        return "--post-validate bypasses the pipeline's step barrier: it needs --pp >= 2"
    if optimizer != "adamw":
        return "--post-validate keeps and restores AdamW's state: use --optimizer adamw"
    if offload or zeropp:
        return (
            "--post-validate restores the masters on the device and writes them back itself: "
            "not with --offload or ZeRO++ (--zeropp-*)"
        )
    return None


def keep(engine):
    """Copies of this rank's fp32 masters and optimizer state (before the optimistic step)."""
    masters = [g.master.detach().clone() for g in engine.groups]
    state = {
        p: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for p, s in engine.optimizer.state.items()
    }
    return masters, state


def restore(engine, kept):
    """Masters and optimizer state back to `kept` (in place: the pieces are views of the masters)."""
    masters, state = kept
    with torch.no_grad():
        for g, m in zip(engine.groups, masters):
            g.master.copy_(m)
    engine.optimizer.state.clear()
    engine.optimizer.state.update(state)


def step(losses, engine, grid, guard, scaler, grad_clip):
    """train.train_step's update, post-validated. losses: (this step's per-micro-batch losses, the
    pp broadcast's Work in flight) from pp.train_step(deferred=True); grad_clip 0: none. -> (mean
    loss, spike, info as engine.step's, with "rolled_back")."""
    clip_norm = grad_clip or None
    # this stage's share of the norm (its dp and tp ranks: they finish together); the sum over the
    # stages in flight, as the last stage's losses are
    losses, loss_work = losses
    square = engine.reduce(scaler, pp=False)
    norm_work = grid.pp.start("all_reduce", square)

    # the optimistic step: clip coefficient 1, nothing skipped
    kept = keep(engine)
    engine.optimizer.step()
    engine.write_back()

    # validate: the global values, as the synchronized step reads them
    for work in (loss_work, norm_work):
        if work is not None:
            work.wait()
    loss = torch.as_tensor(losses.mean().item(), dtype=torch.float32, device=grid.device)
    loss = grid.dp_cp.all_reduce(guard.reported(loss.reshape(1)))
    total, norm = torch.cat([loss.double(), square.sqrt()]).tolist()
    loss = total / grid.dp_cp.size
    spike = guard.spike(loss)
    stepped = math.isfinite(norm) or scaler is None
    if scaler is not None:
        scaler.update(not stepped)
    stepped = stepped and not guard.drops(spike)

    # wrong guess: roll back, redo with the global norm (or only restore the weights: skipped)
    rolled_back = not stepped or clip.coefficient(norm, clip_norm) < 1.0
    if rolled_back:
        restore(engine, kept)
        if stepped:
            clip.clip_(
                [p.master.grad for p in engine.pieces if p.master.grad is not None], norm, clip_norm
            )
            engine.optimizer.step()
        engine.write_back()
    engine.zero_grad()
    COUNTS["steps"] += 1
    COUNTS["rolled_back"] += rolled_back
    return loss, spike, dict(grad_norm=norm, stepped=stepped, finite=True, rolled_back=rolled_back)


def chained(make, steps):
    """The schedule `make` run `steps` times back to back, each rank starting its next step when it
    has finished its own (no barrier; the optimizer step takes no time): micro-batches of step k
    numbered k n .. k n + n - 1, n = m / steps. schedules.simulate runs it (timed=True for
    ZB-H2's plan)."""

    def ops(p, rank, m, v=1):
        n = m // steps
        return [
            [Op(op.kind, op.mb + k * n, op.chunk) for op in rnd]
            for k in range(steps)
            for rnd in make(p, rank, n, v)
        ]

    return ops


def period(traces, n):
    """Per rank: from its first op of the first step to its first op of the second (micro-batches
    >= n), in a chained simulation: the step time without the barrier."""
    return [
        min(e.start for e in t.events if e.mb >= n) - min(e.start for e in t.events) for t in traces
    ]
