"""The layout search: every tp x pp x dp x ZeRO layout a cluster can run, costed and ranked.

Idea: a layout runs when its sizes divide what they split (a node's GPUs, the heads, the layers,
the global batch); layout_error names the first rule one breaks. plan costs each layout that runs
(tools/cost_moe.py, dense or experts) and ranks them: those that fit in memory first, then by step
time. When none fits, smallest_cluster doubles the GPUs until one does, then scans every size below.
Lesson: lessons/21-planning-a-run.md
"""

from nanomega.tools import cost_moe, cp_cost
from nanomega.tools.cost import Run
from nanomega.zero_rules import pipeline_error


def layout_error(model, gpu, gpus, tp, pp, zero, run, global_batch=None, ep=1):
    """Why (tp, pp, zero) cannot run (with experts over ep ranks), in one line naming the flag, or
    None."""
    batch = run.global_batch if global_batch is None else global_batch
    node = min(gpu.per_node, gpus)

    if tp < 1 or pp < 1:
        return f"--tp {tp} and --pp {pp} must be >= 1"
    if node % tp:
        return (
            f"--tp {tp} must divide the {node} GPUs of a node (a tensor-parallel group that spans nodes talks "
            f"over the network, not NVLink): use one of {[t for t in range(1, node + 1) if node % t == 0]}"
        )
    if gpus % (tp * pp):
        return f"--tp {tp} x --pp {pp} = {tp * pp} does not divide --gpus {gpus}"

    # the model's shape
    if model.n_head % tp:
        return f"--tp {tp} does not divide the {model.n_head} heads"
    if model.llama and model.ffn % tp:
        return f"--tp {tp} does not divide the MLP width {model.ffn}"
    if model.llama and model.kv_heads % tp and tp % model.kv_heads:
        return (
            f"--tp {tp} and the {model.kv_heads} key/value heads: one must divide the other (tp splits them, "
            f"or holds them whole on every rank)"
        )
    if pp > model.n_layer:
        return f"--pp {pp} is more than the {model.n_layer} layers"

    # the batch
    dp = gpus // (tp * pp)
    unit = dp * run.micro_batch
    if batch % unit:
        lo, hi = batch // unit * unit, -(-batch // unit) * unit
        near = f"{lo} or {hi}" if lo else f"{hi}"
        return (
            f"--global-batch {batch} is not a multiple of dp {dp} x --micro-batch {run.micro_batch} = {unit} "
            f"(Megatron refuses it too): use {near}"
        )

    if pipeline_error(zero, pp):
        return pipeline_error(zero, pp)
    slots = model.n_layer + (2 if run.split == "llama3" else 0)  # Llama 3's: embedding, head
    if (
        run.schedule == "interleaved"
        and pp > 1
        and (slots % (pp * run.chunks) or (batch // unit) % pp)
    ):
        what = f"{model.n_layer} layers" + (" + 2" if run.split == "llama3" else "")
        return (
            f"interleaved needs --pp x --chunks | {what} and --pp | {batch // unit} micro-batches"
        )
    return cost_moe.layout_error(model, gpus, tp, pp, zero, run, ep)


def layouts(model, gpu, gpus, run, tp=None, pp=None, dp=None, ep=1):
    """(tp, pp, zero) that can run, within the pins; no ZeRO at dp = 1 when ZeRO-0 is on the
    list."""
    for t in [tp] if tp else range(1, min(gpu.per_node, gpus) + 1):
        for p in [pp] if pp else range(1, model.n_layer + 1):
            for zero in run.zero:
                if layout_error(model, gpu, gpus, t, p, zero, run, ep=ep) or (
                    dp and gpus // (t * p) != dp
                ):
                    continue
                if not (zero > 0 and gpus // (t * p) == 1 and 0 in run.zero):
                    yield t, p, zero


def plan(model, gpu, gpus, run=Run(), tp=None, pp=None, dp=None, ep=1, cp=1, cp_method="allgather"):
    """Every layout's Estimate (within the pins): those that fit first, each group ranked by step
    time. With cp > 1 each layout of gpus / cp GPUs takes a cp axis (tools/cp_cost.py)."""
    if cp > 1:
        found = layouts(model, gpu, gpus // cp, run, tp, pp, dp, ep)
        ests = [
            cp_cost.evaluate(model, gpu, gpus, t, p, cp, z, run, cp_method)[0] for t, p, z in found
        ]
    else:
        ests = [
            cost_moe.evaluate(model, gpu, gpus, t, p, z, run, ep)
            for t, p, z in layouts(model, gpu, gpus, run, tp, pp, dp, ep)
        ]
    return sorted(ests, key=lambda e: (not e.fits, e.step_s))


def smallest_cluster(model, gpu, run=Run(), limit=2**20, ep=1):
    """Fewest GPUs (1, 2, 4 .. a node, then whole nodes) with a layout that fits, and its best
    layout. Doubles until one fits, then scans every size below, since divisibility makes fitting
    not monotone in size."""
    hi = gpu.per_node
    while not any(e.fits for e in plan(model, gpu, hi, run, ep=ep)):
        hi *= 2
        if hi > limit:
            return None
    sizes = [2**k for k in range(gpu.per_node.bit_length()) if 2**k < gpu.per_node]
    for g in sizes + list(range(gpu.per_node, hi + 1, gpu.per_node)):
        fit = [e for e in plan(model, gpu, g, run, ep=ep) if e.fits]
        if fit:
            return g, fit[0]
