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
Lesson: lessons/21-planning-a-run.md
"""

import json
from dataclasses import asdict

from nanomega.tools import cost_moe
from nanomega.tools.cost import n_params
from nanomega.tools.layouts import layout_error, plan, smallest_cluster
from nanomega.tools.plan_flags import configure


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
        comm_s=round(e.comm_s, 3),  # every byte's seconds on its link (tools/overlap.py)
        exposed_comm_s=round(e.exposed_s, 3),  # of which the step waits for
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


def main(argv=None):
    args, model, gpu, run, name = configure(argv)
    pinned = (args.tp, args.pp, args.dp)
    if args.tp and args.pp:  # a pinned layout that cannot run: say exactly why
        errors = [
            layout_error(model, gpu, args.gpus // args.cp, args.tp, args.pp, z, run, ep=args.ep)
            for z in run.zero
        ]
        why = errors[0] if all(errors) else None
        if args.dp and args.dp * args.tp * args.pp * args.cp != args.gpus:
            cp = f" x --cp {args.cp}" if args.cp > 1 else ""
            why = f"--dp {args.dp} x --tp {args.tp} x --pp {args.pp}{cp} != --gpus {args.gpus}"
        if why:
            raise SystemExit(f"plan: {why}")
    if run.rampup:
        unit_ok = lambda e: all((x % (e.dp * run.micro_batch)) == 0 for x in run.rampup[:2])
    ests = plan(
        model, gpu, args.gpus, run, *pinned, ep=args.ep, cp=args.cp, cp_method=args.cp_method
    )
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
            f"{', llama3 split' if run.split == 'llama3' else ''}"
            f"{f', cp {args.cp} ' + args.cp_method if args.cp > 1 else ''}"
            f"{', dp overlap' if run.overlap == 'overlap' else ''}{', tp overlap' if run.tp_overlap else ''}"
            f"{', sdpa attention' if run.attention == 'sdpa' else ''}"
            f"{', FP8 GEMMs' if run.fp8 else ''}"
            + (
                f", offload {run.offload:g} of the optimizer state (PCIe {gpu.pcie_bw / 1e9:g} GB/s)"
                if run.offload
                else ""
            )
        )
    if not ests or not ests[0].fits:
        if (
            any(pinned) and ests and not args.json
        ):  # what the pinned layout would cost, then why not
            print(table(ests[: args.top], run))
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
    print(
        f"recommended: {describe(fit[0])} ({len(fit)} of {len(ests)} layouts fit); communication "
        f"{fit[0].comm_s:.3g} s per step, {fit[0].exposed_s:.3g} s of it exposed"
    )
    if model.n_experts:
        print(experts_line(model, gpu, args.gpus, fit[0], run, args.ep))


def cli():
    """The console script (pyproject [project.scripts])."""
    main()


if __name__ == "__main__":
    cli()
