"""Plan a run before paying for it: each tp x pp x dp x ZeRO layout of a cluster, ranked by time.

Lists the layouts the trainer can run (layout_error says why one cannot), costs each with
tools/cost.py (memory per GPU, bytes per step, step time, MFU, days), keeps those that fit in
memory, ranks them by step time and recommends the first; when none fits, it names the smallest
cluster that would. Experts (--ep) are costed by cost_moe.py.

  python -m nanomega.tools.plan --model gpt3-175b --gpus 1024 --gpu a100-80gb --global-batch 1536
  python -m nanomega.tools.plan --model llama3-405b --gpus 8192 --gpu h100-80gb --global-batch 2048
  python -m nanomega.tools.plan --model mixtral-8x7b --gpus 64 --gpu h100-80gb --ep 8
  --tp --pp --dp --zero --micro-batch pin a layout; --json prints machine-readable estimates;
  --top 10 shows the ten best.
Lesson: lessons/11-planning-a-run.md
"""

import argparse
import json
import math
from dataclasses import asdict, replace

from nanomega.tools import cost_moe
from nanomega.tools.cost import GPUS, MODELS, PRECISIONS, Model, Run, n_params
from nanomega.tools.layouts import layout_error, plan, smallest_cluster


# ---- command line --------------------------------------------------------------------------------
def describe(e):
    return f"tp={e.tp} pp={e.pp} dp={e.dp} zero={e.zero}"


def experts_line(model, gpu, gpus, e, run, ep):
    """What the experts cost in layout e (tools/cost_moe.py): active parameters, expert
    memory, all-to-all."""
    total, active = cost_moe.params(model)
    v = run.chunks if run.schedule == "interleaved" and e.pp > 1 else 1
    held = cost_moe.expert_state_bytes(model, e.tp, e.pp, e.dp, e.zero, run.dtype, v, run.split, ep)
    _, _, a2a_b, a2a_s = cost_moe.step_seconds(model, gpu, gpus, e.tp, e.pp, e.zero, run, ep)
    return (
        f"experts: {model.n_experts} per layer, top-{model.top_k}: {active:,} of {total:,} parameters active per "
        f"token ({active / total:.1%}); ep {ep}: {model.n_experts // ep} per GPU and layer, their state "
        f"{held / 1e9:.1f} GB/GPU; all-to-all {a2a_b / 1e9:.2f} GB/GPU/step, {a2a_s:.3f} s of the {e.step_s:.3g} s"
    )


def as_json(e, run, gpu):
    """One estimate, machine-readable: GB (1e9 bytes) per GPU by part, bytes sent, time,
    FLOP/s, MFU, days."""
    gb = {k: round(getattr(e, k) / 1e9, 3) for k in ("params", "grads", "optim", "acts")}

    return dict(
        tp=e.tp,
        pp=e.pp,
        dp=e.dp,
        zero=e.zero,
        micro_batch=run.micro_batch,
        micro_batches=e.micro_batches,
        layers_per_stage=list(e.layers),
        gb_per_gpu=dict(gb, total=round(e.memory / 1e9, 3)),
        usable_gb=round(run.usable * gpu.memory / 1e9, 3),
        fits=e.fits,
        comm_gb_per_gpu_per_step={
            k: round(getattr(e, k + "_comm") / 1e9, 3) for k in ("tp", "pp", "dp")
        },
        step_s=round(e.step_s, 3),
        bubble=round(e.bubble, 4),
        tflops_per_gpu=round(e.tflops / 1e12, 1),
        mfu=round(e.mfu, 4),
        days=round(e.days, 2),
    )


def table(ests, run):
    """One row per layout: sizes, bytes per GPU, bytes each GPU sends per step per axis, time."""
    unit, u = next(
        (n, x) for n, x in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1)) if ests[0].memory >= x
    )
    rows = [
        f" tp  pp   dp zero  mb    m | {unit + '/GPU':>7} {'param':>6} {'grad':>6} {'optim':>6} {'act':>6} | "
        f"{'tp ' + unit:>7} {'pp ' + unit:>6} {'dp ' + unit:>6} | {'step s':>8} {'TFLOP/s':>7} {'MFU':>6} "
        f"{'days':>8}"
    ]
    for e in ests:
        mem = " ".join(f"{x / u:>6.1f}" for x in (e.params, e.grads, e.optim, e.acts))
        rows.append(
            f"{e.tp:>3} {e.pp:>3} {e.dp:>4} {e.zero:>4} {run.micro_batch:>3} {e.micro_batches:>4} | "
            f"{e.memory / u:>7.1f} {mem} | {e.tp_comm / u:>7.1f} {e.pp_comm / u:>6.2f} {e.dp_comm / u:>6.1f}"
            f" | {e.step_s:>8.3g} {e.tflops / 1e12:>7.1f} {e.mfu:>6.1%} {e.days:>8.3g}"
        )
    return "\n".join(rows)


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
    ap.add_argument("--schedule", default=Run.schedule, choices=["gpipe", "1f1b", "interleaved"])
    ap.add_argument(
        "--chunks", type=int, default=Run.chunks, help="model chunks per stage (interleaved)"
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


def main(argv=None):
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
    )
    pinned = (args.tp, args.pp, args.dp)
    if args.tp and args.pp:  # a pinned layout that cannot run: say exactly why
        errors = [
            layout_error(model, gpu, args.gpus, args.tp, args.pp, z, run, ep=args.ep)
            for z in run.zero
        ]
        why = errors[0] if all(errors) else None
        if args.dp and args.dp * args.tp * args.pp != args.gpus:
            why = f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp} != --gpus {args.gpus}"
        if why:
            raise SystemExit(f"plan: {why}")
    if run.rampup:
        unit_ok = lambda e: all((x % (e.dp * run.micro_batch)) == 0 for x in run.rampup[:2])
    ests = plan(model, gpu, args.gpus, run, *pinned, ep=args.ep)
    if run.rampup and ests and not any(unit_ok(e) for e in ests):
        e = ests[0]
        raise SystemExit(
            f"plan: --rampup START and INC must be multiples of dp {e.dp} x --micro-batch "
            f"{run.micro_batch} = {e.dp * run.micro_batch} (Megatron's rule)"
        )
    ests = [e for e in ests if not run.rampup or unit_ok(e)]

    if not args.json:
        llama = (
            f" kv={model.kv_heads} f={model.ffn}{'' if model.tie_embeddings else ' untied'}"
            if model.llama
            else ""
        )
        print(
            f"{name}: {n_params(model):,} parameters, L={model.n_layer} h={model.n_embd} a={model.n_head}{llama} "
            f"V={model.vocab_size} s={model.seq_len} | {args.gpus} x {args.gpu}, {run.usable:.0%} of "
            f"{gpu.memory / 1e9:.1f} GB usable | batch {run.global_batch} x {model.seq_len}, {run.dtype}, "
            f"recompute {run.recompute}{', SP' if run.sp else ''}, {run.schedule}"
            f"{', sdpa attention' if run.attention == 'sdpa' else ''}"
            + (
                f", offload {run.offload:g} of the optimizer state (PCIe {gpu.pcie_bw / 1e9:g} GB/s)"
                if run.offload
                else ""
            )
        )
    if not ests or not ests[0].fits:
        least = min(ests, key=lambda e: e.memory, default=None)
        why = (
            f"{name} needs {least.memory / 1e9:.1f} GB/GPU at least ({describe(least)})"
            if ests
            else f"{args.gpus} GPUs do not split as tp x pp x dp (tp | {min(gpu.per_node, args.gpus)} GPUs of a node "
            f"and {model.n_head} heads, pp <= {model.n_layer} layers, dp x micro-batch | global batch)"
        )
        found = None if any(pinned) else smallest_cluster(model, gpu, run, ep=args.ep)
        hint = (
            f"the smallest cluster that fits is {found[0]} x {args.gpu} ({describe(found[1])}, "
            f"{found[1].memory / 1e9:.1f} GB/GPU)"
            if found
            else "unpin the layout"
            if any(pinned)
            else "no cluster fits: lower --micro-batch or --seq, or use --recompute full"
        )
        raise SystemExit(f"plan: no layout fits: {why}; {hint}")
    fit = [e for e in ests if e.fits]
    if args.json:
        print(
            json.dumps(
                dict(
                    model=name,
                    parameters=n_params(model),
                    gpus=args.gpus,
                    gpu=args.gpu,
                    run={k: v for k, v in asdict(run).items() if k != "zero"},
                    estimates=[as_json(e, run, gpu) for e in fit[: args.top]],
                ),
                indent=1,
            )
        )
        return
    print(table(fit[: args.top], run))
    print(f"recommended: {describe(fit[0])} ({len(fit)} of {len(ests)} layouts fit)")
    if model.n_experts:
        print(experts_line(model, gpu, args.gpus, fit[0], run, args.ep))


def cli():
    """The console script (pyproject [project.scripts])."""
    main()


if __name__ == "__main__":
    cli()
