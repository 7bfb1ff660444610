"""Plan a run before paying for it: memory per GPU, bytes per step and step time of every tp x pp x dp x ZeRO layout.

Idea: put the closed forms of formulas.py together for a model shape and a cluster, keep the layouts that fit
in memory, rank them by predicted step time, recommend the first. It is a model, not a measurement:
    layout     the trainer's: stages split as pp.stage_layers (extra layers on the front stages), the embedding
               on the first stage and the LM head on the last; ranks in the trainer's grid order (dp, pp, tp),
               tp fastest (dist.Grid): a tp group is tp neighbouring ranks, so tp must divide the GPUs of a node
               to stay on NVLink; a pipeline is tp*pp neighbours; a dp group strides over pipelines
    memory     the heaviest stage's parameters, gradients, optimizer state and the activations of the
               micro-batches it holds at its peak; fits if <= usable (0.9) x GPU memory
    time       one micro-batch through the slowest stage (its layers, the head on the last) + its pipeline
               sends, times (m + (p-1)/v) slots, + the dp bytes / link (no overlap, as Megatron-LM 2021). A layer:
                   matmul FLOPs / (peak x MATMUL)
                   + (ELEM bytes x bsh [/t with SP] + SCORE bytes x b(a/t)s^2) / HBM bandwidth
                   + tp bytes / NVLink
               with one set of constants (TIME) fitted on published runs (lessons/11-planning-a-run.md)
    report     TFLOP/s per GPU counting recompute (Megatron's eq. 3 accounting, as papers report it);
               MFU = tokens x (6N + 12Lhs) / (step x GPUs x datasheet peak); days with the batch ramp-up
CLI: python -m nanomega.tools.plan --model gpt3-175b --gpus 1024 --gpu a100-80gb --global-batch 1536 [--top 10]
     pin a layout with --tp --pp --dp --zero --micro-batch; --json for machine-readable estimates
Lesson: lessons/11-planning-a-run.md
"""
import argparse
import json
from dataclasses import asdict, dataclass, replace

from nanomega.formulas import (activation_bytes_per_layer, dp_comm_bytes, flops_per_token,
                                    inflight_microbatches, layer_params, pipeline_bubble, pp_comm_bytes,
                                    tp_comm_bytes_per_layer, zero_state_bytes)
from nanomega.pp import chunk_layers
from nanomega.ops.presets import PRESETS
from nanomega.zero import pipeline_error


@dataclass(frozen=True)
class Model:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int
    alibi: bool = False  # BLOOM: no position embedding table
    embed_layernorm: bool = False  # BLOOM: LayerNorm after the embedding


MODELS = {name: Model(p["n_layer"], p["n_embd"], p["n_head"], p["vocab_size"], p["block_size"], p["alibi"],
                      p["embed_layernorm"]) for name, p in PRESETS.items()}


@dataclass(frozen=True)
class GPU:
    peak_flops: float  # dense bf16 FLOP/s (datasheet)
    memory: float  # bytes
    hbm_bw: float  # bytes/s of device memory
    intra_bw: float  # bytes/s one GPU sends inside a node (NVLink, one direction)
    inter_bw: float  # bytes/s one GPU sends to other nodes (its share of the node's NICs)
    per_node: int = 8


GPUS = {  # NVIDIA datasheets; DGX A100: 8x 200 Gb/s HDR InfiniBand, DGX H100: 8x 400 Gb/s NDR, one NIC per GPU
    "a100-80gb": GPU(312e12, 80 * 2**30, 2039e9, 300e9, 25e9),  # NVLink 3: 600 GB/s both directions
    "h100-80gb": GPU(989e12, 80 * 2**30, 3350e9, 450e9, 50e9),  # H100 SXM, NVLink 4: 900 GB/s both directions
}
PRECISIONS = {"bf16": (2, 4, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}  # bytes/param: (params, grads, optimizer)


@dataclass(frozen=True)
class TimeModel:
    """The constants of the time model, one set for every run, fitted on the calibration rows of lessons/11_plan.py
    (Megatron-LM 2021 Table 1 rows 1, 3, 5, 7, 9 and BLOOM) and checked on the others (rows 2, 4, 6, 8, 10).
    The bytes are effective: what the memory-bound kernels cost, at the datasheet HBM bandwidth."""
    matmul: float = 0.67  # fraction of peak a matmul reaches (qkv, proj, fc1, fc2, QK^T, AV, LM head)
    elem: float = 110.0  # HBM bytes per (b, s, h) element and layer, forward + backward (LayerNorm, dropout, add)
    score: float = 40.0  # HBM bytes per (b, a, s, s) score element and layer, forward + backward (mask, softmax)


TIME = TimeModel()


@dataclass(frozen=True)
class Run:
    global_batch: int = 512  # sequences per optimizer step
    micro_batch: int = 1
    dtype: str = "bf16"
    recompute: str = "selective"  # none | selective | full
    sp: bool = True  # sequence parallelism with TP
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    chunks: int = 2  # model chunks per stage for the interleaved schedule
    zero: tuple = (0, 1, 2, 3)  # ZeRO stages to consider
    usable: float = 0.9  # fraction of GPU memory we plan to fill (CUDA context, NCCL buffers, fragmentation)
    tokens: float = 300e9  # training budget for the days column
    rampup: tuple = None  # Megatron's --rampup-batch-size START INCREMENT SAMPLES


# ---- model shapes -----------------------------------------------------------------------------------------
def padded_vocab(model, tp=1):
    return -(-model.vocab_size // (128 * tp)) * 128 * tp


def layers_per_stage(model, pp, v=1):
    """Layers each pipeline rank holds: the trainer's split (pp.chunk_layers), summed over its v chunks."""
    return [sum(len(chunk_layers(model.n_layer, pp, k, c, v)) for c in range(v)) for k in range(pp)]


def stage_params(model, tp=1, pp=1, v=1):
    """Parameters on one TP rank of each pipeline stage: its layers, the embedding (vocabulary padded to a
    multiple of 128*tp, split by tp; positions replicated) on the first, ln_f and, when pp > 1, its own copy
    of the tied LM head on the last."""
    h = model.n_embd
    wte = padded_vocab(model, tp) // tp * h
    first = wte + (0 if model.alibi else model.seq_len * h) + (2 * h if model.embed_layernorm else 0)
    counts = [n * layer_params(h, tp) for n in layers_per_stage(model, pp, v)]
    counts[0] += first
    counts[-1] += 2 * h + (wte if pp > 1 else 0)
    return counts


def n_params(model):
    return stage_params(model)[0]


# ---- the layout and the cluster ---------------------------------------------------------------------------
def links(gpu, gpus, tp, pp):
    """(pp, dp) bandwidths under the trainer's rank order rank = (d*pp + p)*tp + t. A pipeline is tp*pp
    neighbouring ranks: on NVLink if that fits in a node. A dp group takes one rank per pipeline: inside a node
    if all tp*pp*dp do, else it leaves through the NICs of its k members per node (a ring through a node
    enters and leaves it once per member's NIC), k = per_node / (tp*pp) or 1."""
    per_node = min(gpu.per_node, gpus)
    pp_bw = gpu.intra_bw if tp * pp <= per_node else gpu.inter_bw
    dp_bw = gpu.intra_bw if gpus <= per_node else min(gpu.intra_bw, max(1, per_node // (tp * pp)) * gpu.inter_bw)
    return pp_bw, dp_bw


def layout_error(model, gpu, gpus, tp, pp, zero, run, global_batch=None):
    """Why (tp, pp, zero) cannot run, in one line naming the flag, or None."""
    batch = run.global_batch if global_batch is None else global_batch
    node = min(gpu.per_node, gpus)
    if tp < 1 or pp < 1:
        return f"--tp {tp} and --pp {pp} must be >= 1"
    if node % tp:
        return (f"--tp {tp} must divide the {node} GPUs of a node (a tensor-parallel group that spans nodes talks "
                f"over the network, not NVLink): use one of {[t for t in range(1, node + 1) if node % t == 0]}")
    if gpus % (tp * pp):
        return f"--tp {tp} x --pp {pp} = {tp * pp} does not divide --gpus {gpus}"
    if model.n_head % tp:
        return f"--tp {tp} does not divide the {model.n_head} heads"
    if pp > model.n_layer:
        return f"--pp {pp} is more than the {model.n_layer} layers"
    dp = gpus // (tp * pp)
    unit = dp * run.micro_batch
    if batch % unit:
        lo, hi = batch // unit * unit, -(-batch // unit) * unit
        near = f"{lo} or {hi}" if lo else f"{hi}"
        return (f"--global-batch {batch} is not a multiple of dp {dp} x --micro-batch {run.micro_batch} = {unit} "
                f"(Megatron refuses it too): use {near}")
    if pipeline_error(zero, pp):
        return pipeline_error(zero, pp)
    if run.schedule == "interleaved" and pp > 1 and (model.n_layer % (pp * run.chunks) or (batch // unit) % pp):
        return f"interleaved needs --pp x --chunks | {model.n_layer} layers and --pp | {batch // unit} micro-batches"
    return None


def layouts(model, gpu, gpus, run, tp=None, pp=None, dp=None):
    """(tp, pp, zero) that can run, within the pins; no ZeRO at dp = 1 when ZeRO-0 is on the list."""
    for t in [tp] if tp else range(1, min(gpu.per_node, gpus) + 1):
        for p in [pp] if pp else range(1, model.n_layer + 1):
            for zero in run.zero:
                if layout_error(model, gpu, gpus, t, p, zero, run) or (dp and gpus // (t * p) != dp):
                    continue
                if not (zero > 0 and gpus // (t * p) == 1 and 0 in run.zero):
                    yield t, p, zero


# ---- time -------------------------------------------------------------------------------------------------
def layer_seconds(model, gpu, run, tp, time=TIME):
    """One layer, one micro-batch, forward + backward (+ recompute) on one GPU (the formula in the docstring)."""
    b, s, h, a = run.micro_batch, model.seq_len, model.n_embd, model.n_head
    full, attn_again = run.recompute == "full", run.recompute in ("full", "selective")
    dense = 24 * b * s * h * h / tp * (3 + full)  # forward 1, backward 2, recompute 1
    attn = 4 * b * s * s * h / tp * (3 + attn_again)
    hbm = (time.elem * b * s * h / (tp if run.sp else 1) * (1 + full / 3)
           + time.score * b * a / tp * s * s * (1 + attn_again / 3))
    eb = 4 if run.dtype == "fp32" else 2
    tp_b = tp_comm_bytes_per_layer(b, s, h, tp, eb, run.sp, run.recompute)
    return (dense + attn) / (gpu.peak_flops * time.matmul) + hbm / gpu.hbm_bw + tp_b / gpu.intra_bw


def step_seconds(model, gpu, gpus, tp, pp, zero, run, time=TIME, global_batch=None):
    """(step seconds, bubble fraction) at a global batch (default run.global_batch)."""
    batch = run.global_batch if global_batch is None else global_batch
    dp = gpus // (tp * pp)
    m = batch // (dp * run.micro_batch)
    v = run.chunks if run.schedule == "interleaved" and pp > 1 else 1
    eb = 4 if run.dtype == "fp32" else 2
    layer = layer_seconds(model, gpu, run, tp, time)
    head = 6 * run.micro_batch * model.seq_len * padded_vocab(model, tp) * model.n_embd / tp
    stages = [n * layer for n in layers_per_stage(model, pp, v)]
    stages[-1] += head / (gpu.peak_flops * time.matmul)  # logits forward + 2 backward GEMMs, never recomputed
    pp_bw, dp_bw = links(gpu, gpus, tp, pp)
    sends = pp_comm_bytes(run.micro_batch, model.seq_len, model.n_embd, tp, eb, 1, v) if pp > 1 else 0
    slot = max(stages) + sends / pp_bw
    pipe = (m + (pp - 1) / v) * slot
    dp_b = dp_comm_bytes(max(stage_params(model, tp, pp, v)), zero, dp, PRECISIONS[run.dtype][1],
                         PRECISIONS[run.dtype][0], m)
    return pipe + dp_b / dp_bw, pipeline_bubble(pp, m, v)  # = (p-1)/v slots of the m + (p-1)/v


def train_seconds(step_at, run, seq_len):
    """Seconds for run.tokens tokens. Ramp-up as Megatron's --rampup-batch-size START INC SAMPLES: the batch
    grows START, START+INC, ... each for SAMPLES / ((B - START) / INC) samples, then stays at B."""
    total, done, seconds = run.tokens / seq_len, 0.0, 0.0
    if run.rampup:
        start, inc, samples = run.rampup
        steps = (run.global_batch - start) // inc
        for i in range(steps):
            n = min(samples / steps, total - done)
            seconds += n / (start + i * inc) * step_at(start + i * inc)
            done += n
    return seconds + max(0.0, total - done) / run.global_batch * step_at(run.global_batch)


# ---- the planner ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    tp: int
    pp: int
    dp: int
    zero: int
    micro_batches: int
    layers: tuple  # per pipeline rank
    params: float  # bytes per GPU (the heaviest pipeline stage)
    grads: float
    optim: float
    acts: float
    tp_comm: float  # bytes per GPU per step
    pp_comm: float
    dp_comm: float
    step_s: float
    bubble: float  # fraction of the pipeline time idle
    tflops: float  # per GPU, counting recompute (hardware FLOP/s, as papers report)
    mfu: float  # model FLOPs (6N + 12Lhs) / datasheet peak
    days: float  # run.tokens, with the batch ramp-up
    fits: bool

    @property
    def memory(self):
        return self.params + self.grads + self.optim + self.acts


def evaluate(model, gpu, gpus, tp, pp, zero, run, time=TIME):
    """Memory, bytes, step time, FLOP/s, MFU and days of one layout."""
    L, h, a, s, b = model.n_layer, model.n_embd, model.n_head, model.seq_len, run.micro_batch
    dp = gpus // (tp * pp)
    m = run.global_batch // (dp * b)
    v = run.chunks if run.schedule == "interleaved" and pp > 1 else 1
    pb, gb, ob = PRECISIONS[run.dtype]
    eb = 4 if run.dtype == "fp32" else 2
    layers = layers_per_stage(model, pp, v)
    act = activation_bytes_per_layer(s, b, h, a, tp, run.sp, run.recompute) * eb / 2  # paper counts 2-byte
    # full recompute rebuilds one layer's whole activations in backward: the working set on top of the inputs
    work = activation_bytes_per_layer(s, b, h, a, tp, run.sp) * eb / 2 if run.recompute == "full" else 0
    stages = []
    for k, n in enumerate(stage_params(model, tp, pp, v)):
        state = zero_state_bytes(n, zero, dp, pb, gb, ob)
        held = act * layers[k] * inflight_microbatches(pp - k, m, run.schedule, v) + work
        stages.append((sum(state) + held, state, held))
    _, (params, grads, optim), acts = max(stages, key=lambda x: x[0])
    tp_b = m * max(layers) * tp_comm_bytes_per_layer(b, s, h, tp, eb, run.sp, run.recompute)
    pp_b = pp_comm_bytes(b, s, h, tp, eb, m, v) if pp > 1 else 0
    dp_b = dp_comm_bytes(max(stage_params(model, tp, pp, v)), zero, dp, gb, pb, m)
    step, bubble = step_seconds(model, gpu, gpus, tp, pp, zero, run, time)
    tokens = run.global_batch * s
    n = n_params(model) - (0 if model.alibi else s * h)  # matmul parameters: positions are a lookup
    head = padded_vocab(model) * h
    tflops = tokens * flops_per_token(n, L, h, s, run.recompute, head) / (step * gpus)
    mfu = tokens * flops_per_token(n, L, h, s) / (step * gpus * gpu.peak_flops)
    days = train_seconds(lambda batch: step_seconds(model, gpu, gpus, tp, pp, zero, run, time, batch)[0], run,
                         s) / 86400
    fits = params + grads + optim + acts <= run.usable * gpu.memory
    return Estimate(tp, pp, dp, zero, m, tuple(layers), params, grads, optim, acts, tp_b, pp_b, dp_b, step, bubble,
                    tflops, mfu, days, fits)


def plan(model, gpu, gpus, run=Run(), tp=None, pp=None, dp=None):
    """Every layout's Estimate (within the pins): those that fit first, each group ranked by step time."""
    ests = [evaluate(model, gpu, gpus, t, p, z, run) for t, p, z in layouts(model, gpu, gpus, run, tp, pp, dp)]
    return sorted(ests, key=lambda e: (not e.fits, e.step_s))


def smallest_cluster(model, gpu, run=Run(), limit=2**20):
    """Fewest GPUs (1, 2, 4 .. a node, then whole nodes) with a layout that fits, and its best layout. Doubles
    until one fits, then scans every size below, since divisibility makes fitting not monotone in size."""
    hi = gpu.per_node
    while not any(e.fits for e in plan(model, gpu, hi, run)):
        hi *= 2
        if hi > limit:
            return None
    sizes = [2**k for k in range(gpu.per_node.bit_length()) if 2**k < gpu.per_node]
    for g in sizes + list(range(gpu.per_node, hi + 1, gpu.per_node)):
        fit = [e for e in plan(model, gpu, g, run) if e.fits]
        if fit:
            return g, fit[0]


# ---- command line -----------------------------------------------------------------------------------------
def describe(e):
    return f"tp={e.tp} pp={e.pp} dp={e.dp} zero={e.zero}"


def as_json(e, run, gpu):
    """One estimate, machine-readable: GB (1e9 bytes) per GPU by part, bytes sent, time, FLOP/s, MFU, days."""
    gb = {k: round(getattr(e, k) / 1e9, 3) for k in ("params", "grads", "optim", "acts")}
    return dict(tp=e.tp, pp=e.pp, dp=e.dp, zero=e.zero, micro_batch=run.micro_batch, micro_batches=e.micro_batches,
                layers_per_stage=list(e.layers), gb_per_gpu=dict(gb, total=round(e.memory / 1e9, 3)),
                usable_gb=round(run.usable * gpu.memory / 1e9, 3), fits=e.fits,
                comm_gb_per_gpu_per_step={k: round(getattr(e, k + "_comm") / 1e9, 3) for k in ("tp", "pp", "dp")},
                step_s=round(e.step_s, 3), bubble=round(e.bubble, 4), tflops_per_gpu=round(e.tflops / 1e12, 1),
                mfu=round(e.mfu, 4), days=round(e.days, 2))


def table(ests, run):
    """One row per layout: sizes, bytes per GPU, bytes each GPU sends per step per axis, time."""
    unit, u = next((n, x) for n, x in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1)) if ests[0].memory >= x)
    rows = [f" tp  pp   dp zero  mb    m | {unit + '/GPU':>7} {'param':>6} {'grad':>6} {'optim':>6} {'act':>6} | "
            f"{'tp ' + unit:>7} {'pp ' + unit:>6} {'dp ' + unit:>6} | {'step s':>8} {'TFLOP/s':>7} {'MFU':>6} "
            f"{'days':>8}"]
    for e in ests:
        mem = " ".join(f"{x / u:>6.1f}" for x in (e.params, e.grads, e.optim, e.acts))
        rows.append(f"{e.tp:>3} {e.pp:>3} {e.dp:>4} {e.zero:>4} {run.micro_batch:>3} {e.micro_batches:>4} | "
                    f"{e.memory / u:>7.1f} {mem} | {e.tp_comm / u:>7.1f} {e.pp_comm / u:>6.2f} {e.dp_comm / u:>6.1f}"
                    f" | {e.step_s:>8.3g} {e.tflops / 1e12:>7.1f} {e.mfu:>6.1%} {e.days:>8.3g}")
    return "\n".join(rows)


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m nanomega.tools.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help=f"preset: {', '.join(MODELS)}; or give --layers --hidden --heads --vocab --seq")
    for flag in ("--layers", "--hidden", "--heads", "--vocab", "--seq"):
        ap.add_argument(flag, type=int, help="model shape (overrides the preset's value)")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpu", default="a100-80gb", choices=list(GPUS))
    ap.add_argument("--inter-bw", type=float, help="GB/s each GPU sends to other nodes (default: the GPU preset's)")
    ap.add_argument("--global-batch", type=int, default=Run.global_batch, help="sequences per step")
    ap.add_argument("--micro-batch", type=int, default=Run.micro_batch)
    ap.add_argument("--rampup", type=int, nargs=3, metavar=("START", "INC", "SAMPLES"),
                    help="batch ramp-up as Megatron's --rampup-batch-size (BLOOM: 192 16 9765625)")
    ap.add_argument("--dtype", default=Run.dtype, choices=list(PRECISIONS))
    ap.add_argument("--recompute", default=Run.recompute, choices=["none", "selective", "full"])
    ap.add_argument("--no-sp", action="store_true", help="tensor parallelism without sequence parallelism")
    ap.add_argument("--tp", type=int, help="pin the tensor-parallel size")
    ap.add_argument("--pp", type=int, help="pin the pipeline-parallel size")
    ap.add_argument("--dp", type=int, help="pin the data-parallel size")
    ap.add_argument("--zero", default="all", choices=["all", "0", "1", "2", "3"])
    ap.add_argument("--schedule", default=Run.schedule, choices=["gpipe", "1f1b", "interleaved"])
    ap.add_argument("--chunks", type=int, default=Run.chunks, help="model chunks per stage (interleaved)")
    ap.add_argument("--usable", type=float, default=Run.usable, help="fraction of GPU memory to plan for")
    ap.add_argument("--tokens", type=float, default=Run.tokens, help="token budget for the days column")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print the estimates as JSON")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    flags = {"n_layer": "--layers", "n_embd": "--hidden", "n_head": "--heads", "vocab_size": "--vocab",
             "seq_len": "--seq"}
    given = {k: getattr(args, f[2:]) for k, f in flags.items() if getattr(args, f[2:]) is not None}
    if args.model is not None and args.model not in MODELS:
        raise SystemExit(f"plan: --model {args.model!r} is unknown: use one of {', '.join(MODELS)} "
                         f"or give --layers --hidden --heads --vocab --seq")
    if args.model is None and len(given) < len(flags):
        raise SystemExit(f"plan: without --model give {' '.join(f for k, f in flags.items() if k not in given)}")
    model = replace(MODELS[args.model], **given) if args.model else Model(**given)
    if min(given.values(), default=1) < 1 or model.n_embd % model.n_head:
        raise SystemExit("plan: model sizes must be >= 1 and --hidden a multiple of --heads")
    gpu, name = GPUS[args.gpu], args.model or "model"
    if args.inter_bw is not None:
        gpu = replace(gpu, inter_bw=args.inter_bw * 1e9)
    if args.gpus < 1 or (args.gpus > gpu.per_node and args.gpus % gpu.per_node):
        raise SystemExit(f"plan: --gpus {args.gpus} must be at most one node or whole {gpu.per_node}-GPU nodes")
    if args.micro_batch < 1 or args.global_batch % args.micro_batch or args.global_batch < 1:
        raise SystemExit(f"plan: --global-batch {args.global_batch} must be a multiple of --micro-batch")
    if min(args.chunks, args.usable, args.tokens, args.top, args.inter_bw or 1) <= 0:
        raise SystemExit("plan: --chunks, --usable, --tokens, --inter-bw and --top must be positive")
    if args.rampup and not (0 < args.rampup[0] < args.global_batch and args.rampup[1] > 0 and args.rampup[2] > 0
                            and (args.global_batch - args.rampup[0]) % args.rampup[1] == 0):
        raise SystemExit(f"plan: --rampup {' '.join(map(str, args.rampup))}: need 0 < START < --global-batch, "
                         f"INC > 0 dividing --global-batch - START, SAMPLES > 0")
    run = Run(args.global_batch, args.micro_batch, args.dtype, args.recompute, not args.no_sp, args.schedule,
              args.chunks, (0, 1, 2, 3) if args.zero == "all" else (int(args.zero),), args.usable, args.tokens,
              tuple(args.rampup) if args.rampup else None)
    pinned = (args.tp, args.pp, args.dp)
    if args.tp and args.pp:  # a pinned layout that cannot run: say exactly why
        errors = [layout_error(model, gpu, args.gpus, args.tp, args.pp, z, run) for z in run.zero]
        why = errors[0] if all(errors) else None
        if args.dp and args.dp * args.tp * args.pp != args.gpus:
            why = f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} != --gpus {args.gpus}"
        if why:
            raise SystemExit(f"plan: {why}")
    if run.rampup:
        unit_ok = lambda e: all((x % (e.dp * run.micro_batch)) == 0 for x in run.rampup[:2])
    ests = plan(model, gpu, args.gpus, run, *pinned)
    if run.rampup and ests and not any(unit_ok(e) for e in ests):
        e = ests[0]
        raise SystemExit(f"plan: --rampup START and INC must be multiples of dp {e.dp} x --micro-batch "
                         f"{run.micro_batch} = {e.dp * run.micro_batch} (Megatron's rule)")
    ests = [e for e in ests if not run.rampup or unit_ok(e)]

    if not args.json:
        print(f"{name}: {n_params(model):,} parameters, L={model.n_layer} h={model.n_embd} a={model.n_head} "
              f"V={model.vocab_size} s={model.seq_len} | {args.gpus} x {args.gpu}, {run.usable:.0%} of "
              f"{gpu.memory / 1e9:.1f} GB usable | batch {run.global_batch} x {model.seq_len}, {run.dtype}, "
              f"recompute {run.recompute}{', SP' if run.sp else ''}, {run.schedule}")
    if not ests or not ests[0].fits:
        least = min(ests, key=lambda e: e.memory, default=None)
        why = (f"{name} needs {least.memory / 1e9:.1f} GB/GPU at least ({describe(least)})" if ests else
               f"{args.gpus} GPUs do not split as tp x pp x dp (tp | {min(gpu.per_node, args.gpus)} GPUs of a node "
               f"and {model.n_head} heads, pp <= {model.n_layer} layers, dp x micro-batch | global batch)")
        found = None if any(pinned) else smallest_cluster(model, gpu, run)
        hint = (f"the smallest cluster that fits is {found[0]} x {args.gpu} ({describe(found[1])}, "
                f"{found[1].memory / 1e9:.1f} GB/GPU)" if found else
                "unpin the layout" if any(pinned) else
                "no cluster fits: lower --micro-batch or --seq, or use --recompute full")
        raise SystemExit(f"plan: no layout fits: {why}; {hint}")
    fit = [e for e in ests if e.fits]
    if args.json:
        print(json.dumps(dict(model=name, parameters=n_params(model), gpus=args.gpus, gpu=args.gpu,
                              run={k: v for k, v in asdict(run).items() if k != "zero"},
                              estimates=[as_json(e, run, gpu) for e in fit[:args.top]]), indent=1))
        return
    print(table(fit[:args.top], run))
    print(f"recommended: {describe(fit[0])} ({len(fit)} of {len(ests)} layouts fit)")


def cli():
    """The console script (pyproject [project.scripts])."""
    main()


if __name__ == "__main__":
    cli()
