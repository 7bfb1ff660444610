"""Plan a run before paying for it: memory per GPU, bytes per step and step time of every tp x pp x dp x ZeRO layout.

Idea: put the closed forms of plan_formulas.py together for a model shape and a cluster, keep the layouts that fit
in memory, rank them by predicted step time, recommend the first. It is a model, not a measurement:
    memory     the largest pipeline stage's parameters, gradients, optimizer state, plus activations of the
               micro-batches stage 0 holds at its peak; a layout fits if it needs <= usable (0.9) x GPU memory,
               the rest left for the CUDA context, NCCL buffers, temporaries and fragmentation
    step time  (compute + tp bytes / NVLink + pp bytes / link) x (1 + (p-1)/(v m)) + dp bytes / link, where
               compute = tokens x FLOPs per token (recompute included) / (GPUs x peak x efficiency (0.5)), paced by
               the slowest stage (the last: its layers and the LM head); a dp or pp group that leaves the node
               talks at the GPU's own NIC bandwidth. No overlap of communication with compute, no latency.
    MFU        tokens x (6N + 12Lhs) / (step time x GPUs x peak);  days = token budget / tokens per step x step time
CLI: python -m nanomega.plan --model gpt3-175b --gpus 1024 --gpu a100-80gb --global-batch 1536 [--top 10]
Lesson: lessons/11-planning-a-run.md
"""
import argparse
from dataclasses import dataclass, replace

from nanomega.plan_formulas import (activation_bytes_per_layer, dp_comm_bytes, flops_per_token,
                                    inflight_microbatches, layer_params, pipeline_bubble, pp_comm_bytes,
                                    tp_comm_bytes_per_layer, zero_state_bytes)


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


# ---- model shapes -----------------------------------------------------------------------------------------
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
    if min(args.chunks, args.efficiency, args.usable, args.tokens, args.top) <= 0:
        raise SystemExit("plan: --chunks, --efficiency, --usable, --tokens and --top must be positive")
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
