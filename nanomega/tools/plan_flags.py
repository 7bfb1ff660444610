"""The planner's command line: its flags, and the model, GPU and run they describe, checked.

Each flag reaches one field of tools/cost.py's Model, GPU or Run; bad input is refused in one line
naming the flag (plan: ...), before anything is costed. Every published layout of
tools/published.py can be written with these flags (lesson 21 plans Llama 3 405B's from here).
Lesson: lessons/21-planning-a-run.md
"""

import argparse
import math
from dataclasses import replace

from nanomega.tools.cost import GPUS, MODELS, PRECISIONS, Model, Run


def parse(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m nanomega.tools.plan", description=__doc__.split("\n")[0]
    )

    # the model
    ap.add_argument(
        "--model",
        help=f"preset: {', '.join(MODELS)}; or give --layers --hidden --heads --vocab --seq",
    )
    for flag in ("--layers", "--hidden", "--heads", "--vocab", "--seq"):
        ap.add_argument(flag, type=int, help="model shape (overrides the preset's value)")
    ap.add_argument(
        "--n-experts", type=int, help="routed experts per block (--arch llama presets; 0: dense)"
    )
    ap.add_argument("--top-k", type=int, help="experts per token (default: the preset's, else 2)")
    ap.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size, carved out of dp (experts / ep per GPU)",
    )

    # the machine
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpu", default="a100-80gb", choices=list(GPUS))
    ap.add_argument(
        "--peak-tflops",
        type=float,
        help="measured dense TFLOP/s per GPU in place of the preset's datasheet peak (MFU is then "
        "against it)",
    )
    ap.add_argument(
        "--hbm-tbps", type=float, help="measured TB/s of GPU memory (default: the preset's)"
    )
    ap.add_argument(
        "--inter-bw",
        type=float,
        help="GB/s each GPU sends to other nodes (default: the GPU preset's)",
    )

    # the run
    ap.add_argument("--global-batch", type=int, default=Run.global_batch, help="sequences per step")
    ap.add_argument("--micro-batch", type=int, default=Run.micro_batch)
    ap.add_argument(
        "--rampup",
        type=int,
        nargs=3,
        metavar=("START", "INC", "SAMPLES"),
        help="batch ramp-up as Megatron's --rampup-batch-size (BLOOM: 192 16 9765625)",
    )
    ap.add_argument("--dtype", default=Run.dtype, choices=list(PRECISIONS))
    ap.add_argument("--recompute", default=Run.recompute, choices=["none", "selective", "full"])
    ap.add_argument(
        "--offload",
        type=float,
        default=0.0,
        help="ZeRO-Offload: the share (0-1) of the optimizer "
        "state in host memory: its bytes leave the GPU, PCIe and the CPU Adam join the step time",
    )
    ap.add_argument(
        "--no-sp", action="store_true", help="tensor parallelism without sequence parallelism"
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="train.py --fp8: the blocks' GEMMs at the GPU's datasheet FP8 peak (tools/cost.py "
        "GPUS), attention and the head at the bf16 one",
    )
    ap.add_argument(
        "--attention",
        choices=["eager", "sdpa"],
        help="eager: the scores go through HBM (the Megatron/BLOOM runs the time model was fitted on; "
        "default for GPT-2-style presets); sdpa: FlashAttention, they stay on chip (default for "
        "the llama presets, as every Llama run)",
    )

    # the search: pin a size, or narrow it
    ap.add_argument("--tp", type=int, help="pin the tensor-parallel size")
    ap.add_argument("--pp", type=int, help="pin the pipeline-parallel size")
    ap.add_argument("--dp", type=int, help="pin the data-parallel size")
    ap.add_argument("--zero", default="all", choices=["all", "0", "1", "2", "3"])
    ap.add_argument(
        "--schedule",
        default=Run.schedule,
        choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev"],
    )
    ap.add_argument(
        "--chunks", type=int, default=Run.chunks, help="model chunks per stage (interleaved)"
    )
    ap.add_argument(
        "--split",
        default=Run.split,
        choices=["trainer", "llama3"],
        help="layers per stage: the trainer's, or Llama 3's (the embedding and the head a layer's "
        "slot each: the first and last stages hold a layer less; train.py cannot run it)",
    )
    ap.add_argument(
        "--cp", type=int, default=1, help="context-parallel size (with --tp and --pp pinned)"
    )
    ap.add_argument(
        "--cp-method",
        default="allgather",
        choices=["allgather", "ring", "ulysses"],
        help="how attention trades keys and values over cp (Llama 3: allgather)",
    )
    ap.add_argument(
        "--overlap",
        default=Run.overlap,
        choices=["none", "overlap"],
        help="none: every dp byte waits (Megatron-LM 2021, what the time model was fitted on); "
        "overlap: buckets in backward, ZeRO-3's prefetch (tools/overlap.py)",
    )
    ap.add_argument(
        "--tp-overlap",
        action="store_true",
        help="tp's collectives hide behind the matmuls (Megatron's --tp-comm-overlap, async TP)",
    )
    ap.add_argument(
        "--usable", type=float, default=Run.usable, help="fraction of GPU memory to plan for"
    )
    ap.add_argument(
        "--tokens", type=float, default=Run.tokens, help="token budget for the days column"
    )

    # the output
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print the estimates as JSON")
    return ap.parse_args(argv)


def configure(argv=None):
    """(args, model, gpu, run) of a command line, or SystemExit("plan: ...") naming the bad flag."""
    args = parse(argv)
    flags = {
        "n_layer": "--layers",
        "n_embd": "--hidden",
        "n_head": "--heads",
        "vocab_size": "--vocab",
        "seq_len": "--seq",
    }
    given = {k: getattr(args, f[2:]) for k, f in flags.items() if getattr(args, f[2:]) is not None}
    if args.model is not None and args.model not in MODELS:
        raise SystemExit(
            f"plan: --model {args.model!r} is unknown: use one of {', '.join(MODELS)} "
            f"or give --layers --hidden --heads --vocab --seq"
        )
    if args.model is None and len(given) < len(flags):
        raise SystemExit(
            f"plan: without --model give {' '.join(f for k, f in flags.items() if k not in given)}"
        )
    model = replace(MODELS[args.model], **given) if args.model else Model(**given)
    moe = {k: getattr(args, k) for k in ("n_experts", "top_k") if getattr(args, k) is not None}
    model = replace(model, **moe)
    if model.n_experts and (
        not model.llama or model.n_experts < 2 or not 1 <= model.top_k <= model.n_experts
    ):
        raise SystemExit(
            "plan: --n-experts >= 2 needs a Llama model (a llama preset) and --top-k in [1, n_experts]"
        )
    if min(given.values(), default=1) < 1 or model.n_embd % model.n_head:
        raise SystemExit("plan: model sizes must be >= 1 and --hidden a multiple of --heads")
    gpu, name = GPUS[args.gpu], args.model or "model"
    if args.inter_bw is not None:
        gpu = replace(gpu, inter_bw=args.inter_bw * 1e9)
    new = (args.cp, args.peak_tflops or 1, args.hbm_tbps or 1)
    if not all(math.isfinite(x) and x > 0 for x in new):
        raise SystemExit("plan: --cp, --peak-tflops and --hbm-tbps must be positive and finite")
    measured = {"peak_flops": (args.peak_tflops, 1e12), "hbm_bw": (args.hbm_tbps, 1e12)}
    gpu = replace(gpu, **{k: x * u for k, (x, u) in measured.items() if x is not None})
    if args.gpus < 1 or (args.gpus > gpu.per_node and args.gpus % gpu.per_node):
        raise SystemExit(
            f"plan: --gpus {args.gpus} must be at most one node or whole {gpu.per_node}-GPU nodes"
        )
    if args.micro_batch < 1 or args.global_batch % args.micro_batch or args.global_batch < 1:
        raise SystemExit(
            f"plan: --global-batch {args.global_batch} must be a multiple of --micro-batch"
        )
    if (
        not all(
            math.isfinite(x) and x > 0
            for x in (args.chunks, args.usable, args.tokens, args.top, args.inter_bw or 1)
        )
        or args.usable > 1
        or not 0 <= args.offload <= 1
    ):
        raise SystemExit(
            "plan: --chunks, --usable, --tokens, --inter-bw and --top must be positive and finite, "
            "--usable at most 1 (a fraction of GPU memory), --offload in [0, 1]"
        )
    if args.offload and args.zero == "0":
        raise SystemExit(
            "plan: --offload needs --zero 1, 2 or 3 (as train.py: it offloads a ZeRO engine's state)"
        )
    if args.fp8 and (not gpu.fp8_flops or args.dtype == "fp16" or args.cp > 1):
        raise SystemExit(
            f"plan: --fp8 needs a GPU preset with an FP8 peak ({args.gpu}: "
            f"{gpu.fp8_flops / 1e12:g} TFLOP/s; the A100 has no FP8 units), --dtype bf16 or fp32 "
            "(train.py refuses fp16) and --cp 1 (the cp model prices no FP8 yet)"
        )
    if args.rampup and not (
        0 < args.rampup[0] < args.global_batch
        and args.rampup[1] > 0
        and args.rampup[2] > 0
        and (args.global_batch - args.rampup[0]) % args.rampup[1] == 0
    ):
        raise SystemExit(
            f"plan: --rampup {' '.join(map(str, args.rampup))}: need 0 < START < --global-batch, "
            f"INC > 0 dividing --global-batch - START, SAMPLES > 0"
        )
    run = Run(
        args.global_batch,
        args.micro_batch,
        args.dtype,
        args.recompute,
        not (args.no_sp or model.n_experts),
        args.schedule,
        args.chunks,
        ((1, 2, 3) if args.offload else (0, 1, 2, 3)) if args.zero == "all" else (int(args.zero),),
        args.usable,
        args.tokens,
        tuple(args.rampup) if args.rampup else None,
        args.attention or ("sdpa" if model.llama else "eager"),
        offload=args.offload,
        split=args.split,
        overlap=args.overlap,
        tp_overlap=args.tp_overlap,
        fp8=args.fp8,
    )
    if args.cp > 1 and not (
        args.tp
        and args.pp
        and model.seq_len % (2 * args.cp) == 0
        and args.gpus % (args.tp * args.pp * args.cp) == 0
    ):
        raise SystemExit(
            f"plan: --cp {args.cp} needs --tp and --pp pinned, --tp x --pp x --cp dividing --gpus and "
            f"--seq {model.seq_len} a multiple of 2 x --cp (a cp rank holds two chunks of a sequence)"
        )
    return args, model, gpu, run, name
