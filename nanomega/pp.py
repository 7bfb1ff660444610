"""Pipeline parallelism: consecutive layers on consecutive ranks, micro-batches streamed through
them.

Idea: stage k of p keeps only its share of the blocks (the embedding on the first stage, the final
norm, head and loss on the last). A step runs m micro-batches through the stages in the order a
schedule gives (schedules.py: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV); neighbours exchange
activations (forward) and their gradients (backward) with batched isend/irecv of shapes known in
advance. The tied embedding lives twice, on the first and the last stage, and the two copies'
gradients are summed over grid.embed so they stay equal. A zero-bubble schedule's B computes input
gradients and stashes the weight-gradient GEMMs for its W op (wgrad.py), which runs while p2p calls
are in flight. Which rank holds which virtual stage is the schedule's placement
(schedules.PLACEMENT): on the V (ZB-V, DualPipeV) the first and the last stage are both rank 0, which then holds
the tied embedding once, as the dense model.

Formulas (p stages, m micro-batches of activation memory A each, v chunks per rank):
    bubble = (p - 1) / (v m + p - 1) of every rank's step time
    activations held per stage: GPipe m A, 1F1B min(m, p - rank) A, ZB-H1 (to W) min(m, p) A,
        ZB-V (two chunks of A/2) min(2p, 2m, m + 1 + rank) A/2: p A once m >= 2p - 1
    a sent output (mb, s, h) is freed once sent (Megatron's deallocate trick): saves that much per in-flight mb
Lesson: lessons/08-pipeline-parallel.md
"""

import contextlib

import torch
import torch.nn as nn

from . import dualpipe, moe_overlap, pp_calls, schedules, wgrad
from .schedules import (
    SCHEDULES,
    SPLIT,
    TIMED,
    Comm,
    Op,
    peer,
    placement,
    rank_plan,
    recv_msg,
    send_msg,
    stage_rank,
    virtual_stage,
)


def stage_layers(n_layer, pp, pp_rank) -> range:
    """Layers of stage pp_rank: L // p each, and one more on the first L % p stages (numpy's
    array_split): the extra layers go to the front, away from the last stage, which also runs the LM
    head and the loss."""
    if pp > n_layer:
        raise ValueError(
            f"--pp {pp} is larger than --n-layer {n_layer}: every pipeline stage needs at least "
            f"one layer; use --pp <= {n_layer}"
        )
    size, extra = divmod(n_layer, pp)
    start = pp_rank * size + min(pp_rank, extra)
    return range(start, start + size + (pp_rank < extra))


def check_args(n_layer, pp, microbatches, schedule, virtual=1, compiled=False):
    """One-line errors for a pipeline layout that cannot run; call it before any collective."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"--schedule {schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}"
        )
    if schedule in SPLIT and compiled:
        raise ValueError(
            f"--schedule {schedule} defers weight gradients at run time, which a torch.compile'd "
            f"block's traced backward cannot do: drop --compile, or use --schedule 1f1b"
        )

    if microbatches < 1:
        raise ValueError(f"--microbatches must be >= 1, got {microbatches}")
    if virtual < 1:
        raise ValueError(f"--virtual-stages must be >= 1, got {virtual}")
    if placement(schedule) == "v" and (virtual != 2 or pp < 2):
        raise ValueError(
            f"--schedule {schedule} places two model chunks per rank in a V: it needs --pp >= 2 "
            f"and --virtual-stages 2, got pp {pp}, virtual stages {virtual}"
        )
    if schedule == dualpipe.NAME:
        dualpipe.check(pp, microbatches)
    if schedule != "interleaved" and placement(schedule) != "v" and virtual > 1:
        raise ValueError(f"--virtual-stages {virtual} needs --schedule interleaved")

    if schedule == "interleaved":
        if virtual < 2 or pp < 2:
            raise ValueError(
                f"--schedule interleaved needs --pp >= 2 and --virtual-stages >= 2 (model chunks "
                f"per rank), got pp {pp}, virtual stages {virtual}"
            )
        if n_layer % (pp * virtual):
            raise ValueError(
                f"--schedule interleaved: --n-layer {n_layer} is not divisible by --pp {pp} x "
                f"--virtual-stages {virtual} = {pp * virtual}; use a multiple of {pp * virtual}"
            )
        if microbatches % pp:
            raise ValueError(
                f"--schedule interleaved: --microbatches {microbatches} is not a multiple of --pp "
                f"{pp} (micro-batches enter the chunks in groups of pp); use "
                f"{-(-microbatches // pp) * pp}"
            )

    stage_layers(n_layer, pp * virtual, 0)


def chunk_layers(n_layer, pp, pp_rank, chunk, virtual=1, place="loop") -> range:
    """Layers of model chunk `chunk` on rank pp_rank: its virtual stage (schedules.virtual_stage;
    chunk * pp + pp_rank on the loop) of pp * virtual."""
    return stage_layers(n_layer, pp * virtual, virtual_stage(pp, pp_rank, chunk, place))


def build_stage(model, grid, virtual=1, place="loop"):
    """Keep only this rank's pieces of the dense GPT, in place; parameter names stay the dense
    model's. place: the schedule's placement (schedules.placement).

    With pp > 1 the last stage's LM head gets its own copy of the tied embedding (equal by
    construction, as every rank built the same dense model), tagged `shared_embedding`;
    sync_tied_grads keeps it in sync. On the V the first and the last stage share rank 0: its one
    matrix stays tied, as in the dense model.
    """
    p, rank, n_layer = grid.pp.size, grid.pp_rank, model.cfg.n_layer
    keep = {
        str(i) for c in range(virtual) for i in chunk_layers(n_layer, p, rank, c, virtual, place)
    }
    for key in [k for k in model.blocks if k not in keep]:
        del model.blocks[key]
    first, last = rank == 0, rank == stage_rank(p * virtual - 1, p, place)
    if p > 1 and last and not first and model.cfg.tie_embeddings:
        tied = model.head.lm_head.weight
        copy = nn.Parameter(tied.detach().clone(), requires_grad=tied.requires_grad)
        copy.__dict__.update(tied.__dict__)  # keeps tags such as tensor_parallel
        copy.shared_embedding = True
        model.head.lm_head.weight = copy
    if not first:
        model.embed = None
    if not last:
        model.head = model.mtp = None  # the MTP modules (mtp.py) with the head
    return model


TIED_EMBEDDING = "embed.wte.weight"  # the dense model's name of the matrix the last stage copies


def is_shared_embedding_copy(p):
    """Whether p is the last stage's copy of the tied embedding (build_stage tags it)."""
    return getattr(p, "shared_embedding", False)


def saved_name(name, p):
    """The name a parameter is saved and resharded under: the copy stands for the dense model's
    embedding."""
    return TIED_EMBEDDING if p is not None and is_shared_embedding_copy(p) else name


def tied_embedding(model, grid):
    """This stage's copy of the tied embedding/LM-head matrix, or None (middle stages, pp == 1,
    untied, or both ends on this rank: the V's rank 0 holds one matrix, summed by autograd)."""
    both = model.embed is not None and model.head is not None
    if grid.pp.size == 1 or not model.cfg.tie_embeddings or both:
        return None
    if model.embed is not None:
        return model.embed.wte.weight
    return model.head.lm_head.weight if model.head is not None else None


def sum_tied_grad(grad, grid):
    """Sum the embedding gradient of the first stage and the LM-head gradient of the last
    (Megatron's embedding group), so both copies take the dense model's step: p.grad here
    (sync_tied_grads); under zero.ZeroEngine, tied_rule tells the engine to sum its fp32 gradient
    slice the same way."""
    grid.embed.all_reduce(grad)


def tied_rule(model, grid):
    """The dense group's pipeline rule, zero_rules.Replicas(**tied_rule(...)): this stage's copy of
    the tied embedding in a bucket of its own, its reduced gradient summed over grid.embed with the
    other stage's (sum_tied_grad; extra_sums: () when this stage holds none), and the last stage's
    copy left out of the global norm (uncounted: the first stage's counts it)."""
    weight = tied_embedding(model, grid)
    extra = () if weight is None else ((weight, grid.embed),)
    return dict(extra_sums=extra, uncounted=is_shared_embedding_copy)


def sync_tied_grads(model, grid):
    """sum_tied_grad on this stage's copy's p.grad. Call after backward, before the step."""
    weight = tied_embedding(model, grid)
    if weight is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    sum_tied_grad(weight.grad, grid)


def forward_chunk(model, x, targets, layers, first, last, docs=None):
    """One model chunk: (embedding) -> blocks in `layers` -> (head and loss). x: ids (b, s) or (b,
    s, h); docs: the micro-batch's document ids (b, s) (--document-mask; every stage has its batch)
    or None."""
    if first:
        x = model.embed(x)
    for i in layers:
        x = model.blocks[str(i)](x, docs)
    return model.output(x, targets, docs) if last else x


def train_step(
    model,
    grid,
    micro_batches,
    schedule="1f1b",
    no_sync=contextlib.nullcontext,
    loss_scale=1.0,
    virtual=1,
    act_shape=None,
    trace=None,
    deallocate=True,
    deferred=False,
):
    """Forward and backward of all micro-batches [(x, y) or (x, y, docs), ...] on this stage, in the
    schedule's order.

    The loss is the mean over micro-batches (each backward starts from loss_i / m * loss_scale).
    Returns that mean loss (unscaled) on every rank: the last stage broadcasts the micro-batches'
    losses over the pp axis. deferred: (the losses, the broadcast's Work in flight) instead
    (post_validate.py).
    Activations between stages have act_shape (default (mb, seq, n_embd); (mb, seq/tp, h) with
    sequence parallelism) in the blocks' dtype, the batch dimension each micro-batch's own (a last
    one may be ragged). no_sync wraps every backward but the rank's last one. trace (a
    schedules.Trace) records wall-clock spans and the memory high-water marks.
    """
    check_args(model.cfg.n_layer, grid.pp.size, len(micro_batches), schedule, virtual)
    if schedule in SPLIT and not wgrad.is_split(model):
        raise ValueError(
            f"--schedule {schedule} runs W ops: the model's linear entry must split its backward "
            f"(wgrad.split_backward(model), compose.build does it)"
        )
    losses = _run(
        model,
        grid,
        SCHEDULES[schedule],
        micro_batches,
        virtual,
        placement(schedule),
        act_shape,
        no_sync,
        loss_scale,
        trace,
        deallocate,
        schedule in TIMED,
        not deferred,
    )
    return losses if deferred else losses.mean().item()


@torch.no_grad()
def forward_only(model, grid, micro_batches, act_shape=None, virtual=1, schedule="1f1b"):
    """Mean loss per sequence over the micro-batches, without backward (evaluation), returned on
    every rank of the pp axis: sequence_mean of their losses, so a ragged last micro-batch weighs
    what its sequences do. virtual, schedule: the chunks build_stage cut this stage into and the
    training schedule, whose placement they follow (_run checks the layers match them)."""
    place = placement(schedule)
    losses = _run(model, grid, schedules.forward_only, micro_batches, virtual, place, act_shape)
    return sequence_mean(losses, [len(batch[0]) for batch in micro_batches])


def sequence_mean(losses, sizes) -> float:
    """The mean loss per sequence of micro-batches with mean losses `losses` (a tensor) and `sizes`
    sequences each, in float64: every micro-batch weighted by its size (the plain mean over
    micro-batches would weigh an evaluation's ragged last one, 2 sequences, as much as a full one of
    16). One home for the pipelined and the plain evaluation (train.evaluate), so the two agree
    bitwise wherever their per-micro-batch losses do."""
    weights = torch.tensor(sizes, dtype=torch.float64, device=losses.device)
    return ((losses.double() * weights).sum() / weights.sum()).item()


def _run(
    model,
    grid,
    make,
    micro_batches,
    virtual,
    place,
    act_shape,
    no_sync=contextlib.nullcontext,
    loss_scale=1.0,
    trace=None,
    deallocate=True,
    timed=False,
    wait=True,
):
    p, rank, m = grid.pp.size, grid.pp_rank, len(micro_batches)
    n_layer, last_vs = model.cfg.n_layer, p * virtual - 1
    layers = [chunk_layers(n_layer, p, rank, c, virtual, place) for c in range(virtual)]
    expected = {str(i) for chunk in layers for i in chunk}
    if expected != set(model.blocks):
        raise ValueError(
            f"pipeline stage {rank} holds layers {sorted(map(int, model.blocks))} but {virtual} "
            f"chunk(s) per rank ({place}) need {sorted(map(int, expected))}: pass the virtual and "
            f"the placement given to build_stage"
        )
    x0 = micro_batches[0][0]
    shape = act_shape or (x0.shape[0], x0.shape[1], model.cfg.n_embd)
    dtype = next(model.blocks.parameters()).dtype
    steps = rank_plan(make, p, rank, m, virtual, place, timed)  # ops, the p2p calls between them
    ops = [step for step in steps if isinstance(step, Op)]
    split = any(op.kind == "W" for op in ops)
    # the one synced op: the rank's last W (split backward), else its last B. Not one per chunk: the
    # engine's buckets span the chunks, and a synced backward ends reducing every bucket (ddp.py's
    # _end_backward), an earlier chunk's partial sums too: twice the traffic, 1F1B's sums reordered
    last_grad_op = next((op for op in reversed(ops) if op.kind == ("W" if split else "B")), None)
    sync = torch.accelerator.synchronize if grid.device.type != "cpu" else (lambda: None)
    # live: (chunk, mb) -> (input, output) awaiting B; deferred: (chunk, mb) -> W's stash
    live, deferred, inbox, outbox, losses = {}, {}, {}, {}, []
    calls = pp_calls.Calls(grid, p, rank, deallocate, eager=split, place=place)
    pairs = {f for f, _ in dualpipe.pairs(make(p, rank, m, virtual))} if place == "v" else set()

    def run(step):  # one op: F, B or W
        vs = virtual_stage(p, rank, step.chunk, place)
        calls.wait_for(recv_msg(step, p, rank, virtual, place))
        reduce = step == last_grad_op
        with trace.span(step, sync) if trace else contextlib.nullcontext():
            if step.kind == "F":
                x, y, *docs = micro_batches[step.mb]
                if vs > 0:  # the previous stage's output: received, or this rank's (the V's turn)
                    x = inbox.pop(recv_msg(step, p, rank, virtual, place)).requires_grad_()
                held = layers[step.chunk]
                out = forward_chunk(
                    model, x, y if vs == last_vs else None, held, vs == 0, vs == last_vs, *docs
                )
                if vs == last_vs:
                    losses.append(out.detach())
                    out = out / m * loss_scale
                if torch.is_grad_enabled():
                    live[(step.chunk, step.mb)] = (x, out)
            elif step.kind == "B":
                x, out = live.pop((step.chunk, step.mb))
                grad = (
                    torch.ones_like(out)
                    if vs == last_vs
                    else inbox.pop(recv_msg(step, p, rank, virtual, place))
                )
                # split: the weight gradients wait in a stash for this micro-batch's W
                defer = wgrad.deferring() if split else contextlib.nullcontext()
                with no_sync() if not reduce else contextlib.nullcontext(), defer as stash:
                    pp_calls.backward(out, grad)
                if split:
                    deferred[(step.chunk, step.mb)] = stash
            else:
                with no_sync() if not reduce else contextlib.nullcontext():
                    wgrad.flush(deferred.pop((step.chunk, step.mb)))
            if trace:
                held = len(set(live) | set(deferred))
                trace.peak_inflight = max(trace.peak_inflight, held)
        msg = send_msg(step, p, rank, virtual, place)
        if msg and peer(msg, p, rank, place) == rank:  # the V's turn: the next chunk is here
            inbox[msg] = out.detach() if step.kind == "F" else x.grad
        elif msg:
            outbox[msg] = out if step.kind == "F" else x.grad

    todo = iter(steps)
    for step in todo:
        if isinstance(step, Comm):
            # a micro-batch's activation (or its gradient) has its own batch size: an evaluation's
            # last micro-batch may be ragged, and a receive larger than its send would hang NCCL
            inbox.update(
                {
                    msg: torch.empty(
                        (len(micro_batches[msg[1]][0]), *shape[1:]), dtype=dtype, device=grid.device
                    )
                    for msg in step.recvs
                }
            )
            calls.post(step, [outbox.pop(msg) for msg in step.sends], inbox)
            if trace:
                held = sum(out.untyped_storage().nbytes() for _, out in live.values() if out.dim())
                trace.peak_output_bytes = max(trace.peak_output_bytes, held)
            continue
        if step in pairs:  # DualPipeV's overlapped pair: F, then the full backward B, W
            b, w = next(todo), next(todo)
            calls.wait_for(recv_msg(b, p, rank, virtual, place))
            moe_overlap.run_pair(lambda: run(step), lambda: (run(b), run(w)))
        else:
            run(step)

    calls.wait_all()
    losses = torch.stack(losses) if losses else torch.zeros(m, device=grid.device)
    # each micro-batch's loss, on every stage, from the rank holding the last virtual stage
    return grid.pp.broadcast(losses, src_index=stage_rank(last_vs, p, place), wait=wait)
