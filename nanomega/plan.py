"""Plan a run before paying for it: memory per GPU, bytes per step and step time for every tp x pp x dp x ZeRO layout.

Idea: every quantity the parallel modules count (parameters held, bytes sent, activations kept) has a closed form.
Put them together for a model shape and a cluster, keep the layouts that fit in memory, rank them by predicted
step time. It is a model, not a measurement: no overlap of communication with compute, no latency, nominal link
bandwidths, one compute efficiency for every layout (default 0.5 of peak).

Formulas (Psi = parameters held by one tp x pp rank, d/t/p = dp/tp/pp sizes, m = micro-batches per step, B = bytes):
    state      (B_param, B_grad, B_optim) * Psi; ZeRO stage 1 divides the optimizer term by d, 2 also the
               gradients, 3 also the parameters (ZeRO paper: fp16 + Adam, 2 + 2 + 12; Megatron bf16 params with
               fp32 grads: 18 -> 6 + 12/d with the distributed optimizer)
    dp bytes   ring all-reduce 2(d-1)/d * Psi*B; reduce-scatter and all-gather (d-1)/d each; ZeRO-3 = 3(d-1)/d (1.5x)
    tp bytes   4 all-reduces of b*s*h per layer and micro-batch (2 forward, 2 backward), 2(t-1)/t each in a ring
    activation Korthikanti et al. 2022, per layer and micro-batch: sbh(34 + 5as/h); TP sbh(10 + 24/t + 5as/(ht));
               TP+SP sbh(34 + 5as/h)/t; selective recompute drops the 5as/h term; full recompute keeps 2sbh
    bubble     (p-1) / (v*m + p-1) of the step is idle (v = interleaved chunks per stage)
    FLOPs      6N + 12*L*h*s per token (PaLM / nanoGPT: QK^T and AV counted without causal halving)
Lesson: lessons/11-planning-a-run.md
"""
import argparse
import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Model:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int
    alibi: bool = False  # BLOOM: no position embedding table
    embed_layernorm: bool = False  # BLOOM: LayerNorm after the embedding


MODELS = {  # GPT-3 paper Table 2.1 (1.3B: 16 heads of 128, the table's 24 heads do not divide 2048), OPT, BLOOM
    "tiny": Model(4, 64, 4, 256, 64),
    "gpt2-small": Model(12, 768, 12, 50257, 1024), "gpt2-medium": Model(24, 1024, 16, 50257, 1024),
    "gpt2-large": Model(36, 1280, 20, 50257, 1024), "gpt2-xl": Model(48, 1600, 25, 50257, 1024),
    "gpt3-1.3b": Model(24, 2048, 16, 50257, 2048), "gpt3-6.7b": Model(32, 4096, 32, 50257, 2048),
    "gpt3-13b": Model(40, 5120, 40, 50257, 2048), "gpt3-175b": Model(96, 12288, 96, 50257, 2048),
    "opt-175b": Model(96, 12288, 96, 50272, 2048),
    "bloom-176b": Model(70, 14336, 112, 250880, 2048, alibi=True, embed_layernorm=True),
    "mt-nlg-530b": Model(105, 20480, 128, 51200, 2048),  # Korthikanti et al. Table 3
}


@dataclass(frozen=True)
class GPU:
    peak_flops: float  # dense bf16 FLOP/s
    memory: float  # bytes
    intra_bw: float  # bytes/s one GPU sends inside a node (NVLink, one direction)
    inter_bw: float  # bytes/s one GPU sends to other nodes (its own NIC)
    per_node: int = 8


GPUS = {  # NVIDIA datasheets; DGX A100: 8x 200 Gb/s HDR InfiniBand, DGX H100: 8x 400 Gb/s NDR, one NIC per GPU
    "a100-80gb": GPU(312e12, 80 * 2**30, 300e9, 25e9),  # NVLink 3: 600 GB/s both directions
    "h100-80gb": GPU(989e12, 80 * 2**30, 450e9, 50e9),  # H100 SXM, NVLink 4: 900 GB/s both directions
}
PRECISIONS = {"bf16": (2, 4, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}  # bytes/param: (params, grads, optimizer)


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
    efficiency: float = 0.5  # achieved fraction of peak FLOP/s in matmuls
    usable: float = 0.9  # fraction of GPU memory we plan to fill (CUDA context, NCCL buffers, fragmentation)
    tokens: float = 300e9  # training budget for the days column


# ---- parameters -------------------------------------------------------------------------------------------
def layer_params(h, t=1):
    """One Block on one TP rank: qkv, fc weights and their biases split by t (column parallel); projection
    weights split (row parallel), their biases and both LayerNorms replicated. t=1: 12h^2 + 13h."""
    return (12 * h * h + 7 * h) // t + 6 * h


def stage_params(model, tp=1, pp=1):
    """Parameters on one TP rank of each pipeline stage; the vocabulary is padded to a multiple of 128*tp and
    split by tp, positions are replicated; the last stage keeps its own copy of the tied LM head when pp > 1."""
    h = model.n_embd
    wte = -(-model.vocab_size // (128 * tp)) * 128 * h
    first = wte + (0 if model.alibi else model.seq_len * h) + (2 * h if model.embed_layernorm else 0)
    counts = [model.n_layer // pp * layer_params(h, tp)] * pp
    counts[0] += first
    counts[-1] += 2 * h + (wte if pp > 1 else 0)  # ln_f (+ untied head copy)
    return counts


def n_params(model):
    return stage_params(model)[0]


# ---- memory -----------------------------------------------------------------------------------------------
def zero_state_bytes(n_params, stage, dp, param_bytes=2, grad_bytes=2, optim_bytes=12):
    """(parameter, gradient, optimizer) bytes on one DP rank. Stage 1 shards the optimizer state, 2 also the
    gradients, 3 also the parameters; a shard is ceil(n/dp) elements (flat buffer padded to a multiple of dp)."""
    shard = math.ceil(n_params / dp)
    p, g, o = (shard if stage >= k else n_params for k in (3, 2, 1))
    return p * param_bytes, g * grad_bytes, o * optim_bytes


def activation_bytes_per_layer(s, b, h, a, t=1, sp=False, recompute="none"):
    """Saved activations of one layer for one micro-batch (Korthikanti et al. 2022, Table 2): 2-byte tensors,
    1-byte dropout masks. Of the 34 sbh, 10 (LayerNorm and block inputs, two dropout masks) are replicated by
    TP unless SP shards them; 5as/h is the (b, a, s, s) softmax, its dropout mask and dropped output."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh  # only the layer input (the paper's Table 2 counts it unsharded)
    attn = 0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return sbh * (34 + attn) / t
    return sbh * (10 + 24 / t + attn / t)


def inflight_microbatches(p, m, schedule="1f1b", v=1):
    """Micro-batches whose activations stage 0 holds at its peak, in units of one stage's L/p layers: GPipe
    all m, 1F1B p (its warm-up), interleaved p + (p-1)/v, i.e. Korthikanti's L(1 + (p-1)/(pv)) layers."""
    if p == 1:
        return 1  # plain gradient accumulation: one micro-batch at a time
    return {"gpipe": m, "1f1b": min(p, m), "interleaved": p + (p - 1) / v}[schedule]


# ---- communication (bytes one rank sends per step; a ring receives as much as it sends) ------------------
def dp_comm_bytes(n_params, stage, dp, dtype_bytes, param_bytes=None, micro_batches=1):
    """Stage 0: all-reduce the gradients once. 1: reduce-scatter them, all-gather the updated parameters.
    2: as 1, but the reduce-scatter runs every micro-batch (no full gradient is kept to accumulate into).
    3: also all-gather the parameters for forward and again for backward of every micro-batch.
    dtype_bytes: gradient elements on the wire; param_bytes: parameter elements (default the same)."""
    param_bytes = dtype_bytes if param_bytes is None else param_bytes
    f = (dp - 1) / dp * n_params
    if stage == 0:
        return 2 * f * dtype_bytes
    grads = f * dtype_bytes * (micro_batches if stage >= 2 else 1)
    return grads + f * param_bytes * (2 * micro_batches if stage == 3 else 1)


def tp_comm_bytes_per_layer(b, s, h, t, dtype_bytes=2, sequence_parallel=False, recompute="none"):
    """Per layer and micro-batch: attention and MLP each end in an all-reduce of (b, s, h) in forward and
    start with one in backward. SP replaces each by a reduce-scatter plus an all-gather: the same bytes, but
    the activations between them are sharded. Full recompute reruns the 2 forward collectives."""
    ring = (t - 1) / t + (t - 1) / t if sequence_parallel else 2 * (t - 1) / t
    return (6 if recompute == "full" else 4) * ring * b * s * h * dtype_bytes


def pp_comm_bytes(b, s, h, t, dtype_bytes, micro_batches, v=1):
    """Activation forward, its gradient backward, per micro-batch and model chunk; each TP rank sends its 1/t
    slice (SP shards it anyway; without SP, Megatron's scatter/gather optimisation, Narayanan et al. 2021)."""
    return 2 * v * micro_batches * b * s * h * dtype_bytes / t


# ---- time -------------------------------------------------------------------------------------------------
def pipeline_bubble(p, m, v=1):
    """Idle fraction of the step: each stage waits p-1 slots out of v*m + p-1 (a slot = one micro-batch's
    forward + backward of one chunk; interleaving shrinks the slots by v). Time = ideal * (1 + (p-1)/(v m))."""
    return (p - 1) / (v * m + p - 1)


def flops_per_token(n_params, n_layer, h, s, recompute="none"):
    """6N (forward 2N, backward 4N) + 12*L*h*s for QK^T and AV, counted without causal halving (PaLM, nanoGPT).
    Recompute adds forward work that MFU does not credit: full one forward (2N + 4Lhs), selective QK^T, AV."""
    extra = {"none": 0, "selective": 4 * n_layer * h * s, "full": 2 * n_params + 4 * n_layer * h * s}[recompute]
    return 6 * n_params + 12 * n_layer * h * s + extra


def implied_mfu(total_flops, days, gpus, peak_flops):
    """Model FLOPs utilisation a reported run implies: useful FLOPs / (wall time * GPUs * peak)."""
    return total_flops / (days * 86400 * gpus * peak_flops)


# ---- the planner ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    tp: int
    pp: int
    dp: int
    zero: int
    micro_batches: int
    params: float  # bytes per GPU (the largest pipeline stage)
    grads: float
    optim: float
    acts: float
    tp_comm: float  # bytes per GPU per step
    pp_comm: float
    dp_comm: float
    step_s: float
    mfu: float
    days: float
    fits: bool

    @property
    def memory(self):
        return self.params + self.grads + self.optim + self.acts


def evaluate(model, gpu, gpus, tp, pp, zero, run):
    """Memory, bytes and step time of one layout. Rank order is Megatron's: tp innermost, then dp, then pp, so
    an axis stays inside a node when it times the axes inside it fits in one (tp always does)."""
    L, h, a, s, b = model.n_layer, model.n_embd, model.n_head, model.seq_len, run.micro_batch
    dp = gpus // (tp * pp)
    m = run.global_batch // (dp * b)
    v = run.chunks if run.schedule == "interleaved" and pp > 1 else 1
    pb, gb, ob = PRECISIONS[run.dtype]
    eb = 4 if run.dtype == "fp32" else 2  # bytes of an activation element on the wire
    n_rank = max(stage_params(model, tp, pp))
    params, grads, optim = zero_state_bytes(n_rank, zero, dp, pb, gb, ob)
    act = activation_bytes_per_layer(s, b, h, a, tp, run.sp, run.recompute) * eb / 2  # paper counts 2-byte
    acts = act * (L // pp) * inflight_microbatches(pp, m, run.schedule, v)
    tp_b = m * (L // pp) * tp_comm_bytes_per_layer(b, s, h, tp, eb, run.sp, run.recompute)
    pp_b = pp_comm_bytes(b, s, h, tp, eb, m, v) if pp > 1 else 0
    dp_b = dp_comm_bytes(n_rank, zero, dp, gb, pb, m)
    per_node = min(gpu.per_node, gpus)
    dp_bw = gpu.intra_bw if tp * dp <= per_node else gpu.inter_bw
    pp_bw = gpu.intra_bw if gpus <= per_node else gpu.inter_bw
    tokens = run.global_batch * s
    n = n_params(model) - (0 if model.alibi else s * h)  # matmul parameters: positions are a lookup
    head = n - L * layer_params(h)  # the tied LM head (and final LayerNorm) on the last stage
    slowest = pp * (L // pp * layer_params(h) + head)  # that stage sets the pace: as if every stage were it
    compute = tokens * flops_per_token(slowest, L, h, s, run.recompute) / (gpus * gpu.peak_flops * run.efficiency)
    step = (compute + tp_b / gpu.intra_bw + pp_b / pp_bw) / (1 - pipeline_bubble(pp, m, v)) + dp_b / dp_bw
    mfu = tokens * flops_per_token(n, L, h, s) / (step * gpus * gpu.peak_flops)
    fits = params + grads + optim + acts <= run.usable * gpu.memory
    return Estimate(tp, pp, dp, zero, m, params, grads, optim, acts, tp_b, pp_b, dp_b, step, mfu,
                    run.tokens / tokens * step / 86400, fits)


def layouts(model, gpu, gpus, run):
    """(tp, pp, zero) choices: tp divides the node and the heads, pp the layers, dp x micro-batch the global
    batch; no ZeRO-2/3 with pipeline parallelism (DeepSpeed refuses it), no ZeRO at dp = 1 (it is ZeRO-0);
    interleaving needs p*v | L and p | m (Megatron's rules)."""
    for tp in (t for t in range(1, min(gpu.per_node, gpus) + 1) if gpus % t == 0 and model.n_head % t == 0):
        for pp in (p for p in range(1, model.n_layer + 1) if model.n_layer % p == 0 and gpus % (tp * p) == 0):
            dp = gpus // (tp * pp)
            m, rest = divmod(run.global_batch, dp * run.micro_batch)
            if rest or m == 0 or (run.schedule == "interleaved" and pp > 1 and
                                  (model.n_layer % (pp * run.chunks) or m % pp)):
                continue
            for zero in run.zero:
                if not ((zero >= 2 and pp > 1) or (zero > 0 and dp == 1 and 0 in run.zero)):
                    yield tp, pp, zero


def plan(model, gpu, gpus, run=Run()):
    """Every layout's Estimate: those that fit first, each group ranked by predicted step time."""
    ests = [evaluate(model, gpu, gpus, tp, pp, z, run) for tp, pp, z in layouts(model, gpu, gpus, run)]
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


def table(ests, run):
    """One row per layout: sizes, bytes per GPU, bytes each GPU sends per step per axis, time."""
    unit, u = next((n, x) for n, x in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1)) if ests[0].memory >= x)
    rows = [f" tp  pp   dp zero  mb    m | {unit + '/GPU':>7} {'param':>6} {'grad':>6} {'optim':>6} {'act':>6} | "
            f"{'tp ' + unit:>7} {'pp ' + unit:>6} {'dp ' + unit:>6} | {'step s':>8} {'MFU':>6} {'days':>8}"]
    for e in ests:
        mem = " ".join(f"{x / u:>6.1f}" for x in (e.params, e.grads, e.optim, e.acts))
        rows.append(f"{e.tp:>3} {e.pp:>3} {e.dp:>4} {e.zero:>4} {run.micro_batch:>3} {e.micro_batches:>4} | "
                    f"{e.memory / u:>7.1f} {mem} | {e.tp_comm / u:>7.1f} {e.pp_comm / u:>6.2f} {e.dp_comm / u:>6.1f}"
                    f" | {e.step_s:>8.3g} {e.mfu:>6.1%} {e.days:>8.3g}")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m nanomega.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help=f"preset: {', '.join(MODELS)}; or give --layers --hidden --heads --vocab --seq")
    for flag in ("--layers", "--hidden", "--heads", "--vocab", "--seq"):
        ap.add_argument(flag, type=int, help="model shape (overrides the preset's value)")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpu", default="a100-80gb", choices=list(GPUS))
    ap.add_argument("--global-batch", type=int, default=Run.global_batch, help="sequences per step")
    ap.add_argument("--micro-batch", type=int, default=Run.micro_batch)
    ap.add_argument("--dtype", default=Run.dtype, choices=list(PRECISIONS))
    ap.add_argument("--recompute", default=Run.recompute, choices=["none", "selective", "full"])
    ap.add_argument("--no-sp", action="store_true", help="tensor parallelism without sequence parallelism")
    ap.add_argument("--zero", default="all", choices=["all", "0", "1", "2", "3"])
    ap.add_argument("--schedule", default=Run.schedule, choices=["gpipe", "1f1b", "interleaved"])
    ap.add_argument("--chunks", type=int, default=Run.chunks, help="model chunks per stage (interleaved)")
    ap.add_argument("--efficiency", type=float, default=Run.efficiency, help="achieved fraction of peak FLOP/s")
    ap.add_argument("--usable", type=float, default=Run.usable, help="fraction of GPU memory to plan for")
    ap.add_argument("--tokens", type=float, default=Run.tokens, help="token budget for the days column")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args(argv)

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
    if args.gpus < 1 or (args.gpus > gpu.per_node and args.gpus % gpu.per_node):
        raise SystemExit(f"plan: --gpus {args.gpus} must be at most one node or whole {gpu.per_node}-GPU nodes")
    if args.micro_batch < 1 or args.global_batch % args.micro_batch or args.global_batch < 1:
        raise SystemExit(f"plan: --global-batch {args.global_batch} must be a multiple of --micro-batch")
    run = Run(args.global_batch, args.micro_batch, args.dtype, args.recompute, not args.no_sp, args.schedule,
              args.chunks, (0, 1, 2, 3) if args.zero == "all" else (int(args.zero),), args.efficiency,
              args.usable, args.tokens)

    print(f"{name}: {n_params(model):,} parameters, L={model.n_layer} h={model.n_embd} a={model.n_head} "
          f"V={model.vocab_size} s={model.seq_len} | {args.gpus} x {args.gpu}, {run.usable:.0%} of "
          f"{gpu.memory / 1e9:.1f} GB usable | batch {run.global_batch} x {model.seq_len}, {run.dtype}, "
          f"recompute {run.recompute}{', SP' if run.sp else ''}, {run.schedule}, efficiency {run.efficiency:.0%}")
    ests = plan(model, gpu, args.gpus, run)
    if not ests or not ests[0].fits:
        least = min(ests, key=lambda e: e.memory, default=None)
        why = (f"{name} needs {least.memory / 1e9:.1f} GB/GPU at least ({describe(least)})" if ests else
               f"{args.gpus} GPUs do not split as tp x pp x dp (tp | {min(gpu.per_node, args.gpus)} and "
               f"{model.n_head} heads, pp | {model.n_layer} layers, dp x micro-batch | global batch)")
        found = smallest_cluster(model, gpu, run)
        hint = (f"the smallest cluster that fits is {found[0]} x {args.gpu} ({describe(found[1])}, "
                f"{found[1].memory / 1e9:.1f} GB/GPU)" if found else
                "no cluster fits: lower --micro-batch or --seq, or use --recompute full")
        raise SystemExit(f"plan: no layout fits: {why}; {hint}")
    fit = [e for e in ests if e.fits]
    print(table(fit[:args.top], run))
    print(f"recommended: {describe(fit[0])} ({len(fit)} of {len(ests)} layouts fit)")


if __name__ == "__main__":
    main()
