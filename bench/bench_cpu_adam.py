"""CPUAdamW (nanomega/cpu_adam.py) vs torch.optim.AdamW foreach and fused: one optimizer step on the
CPU.

    python bench/bench_cpu_adam.py                          # 100M fp32 parameters, threads 1 and 2, 7 repeats
    python bench/bench_cpu_adam.py --params 1e7 --threads 1 --repeats 3

The parameters are one flat fp32 tensor (ZeRO-Offload's layout: a host master buffer; --tensors N
splits them into N equal tensors), with random gradients; every optimizer steps the same tensors and
keeps its own state, warmed by one untimed step. CPUAdamW runs on every ISA path this CPU executes
(NANOMEGA_ADAM_ISA set per step; its first row is the path it takes by default, the one the last
column divides by). The optimizers run interleaved, repeat after repeat, so background load hits
them alike; the table shows the min (the least disturbed repeat) and the median. Bytes per element
and step (cpu_adam.py's formula): 28 for the one-pass kernels (CPUAdamW, torch fused), 80 for
foreach; GB/s = bytes / min. The load average of the machine (2 cores shared with other jobs) is
printed before and after.
Issue 32: CPUAdamW should beat foreach, and fused where the CPU build has it, at 1 and 2 threads.
A second table times ZeRO-Offload's whole host step of a bf16 model (offload.py): the clip
coefficient applied to the gradient, AdamW, the new weights rounded to bf16 for the upload -- one
pass of CPUAdamW's kernel (30 bytes per element) against torch's optimizers with the scaling and the
cast as passes of their own (42 with fused; 38 with the scaling inside fused's pass through
GradScaler's grad_scale hook, which writes the gradient back).
"""

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanomega import cpu_adam, extension  # noqa: E402

FUSED_BYTES, FOREACH_BYTES = 28, 80  # per element and step (nanomega/cpu_adam.py's formula)


def fused_available():
    """torch.optim.AdamW(fused=True) on CPU fp32 tensors, or the one-line reason it is refused."""
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    try:
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, ValueError) as e:
        return str(e).strip().splitlines()[0]
    return None


def on_path(opt, isa):
    """opt.step with the kernel forced onto one ISA path ($NANOMEGA_ADAM_ISA is read at every
    call)."""

    def step():
        os.environ["NANOMEGA_ADAM_ISA"] = isa
        try:
            opt.step()
        finally:
            del os.environ["NANOMEGA_ADAM_ISA"]

    return step


def optimizers(params, lr=1e-3):
    """name -> (step function, bytes per element): CPUAdamW on each path this CPU runs (the first:
    the default), torch foreach, torch fused when available. Each keeps its own state over the same
    parameters."""
    out = {
        f"CPUAdamW {isa}": (on_path(cpu_adam.CPUAdamW(params, lr=lr), isa), FUSED_BYTES)
        for isa in cpu_adam.isas() or ["pytorch"]
    }
    out["torch foreach"] = (torch.optim.AdamW(params, lr=lr, foreach=True).step, FOREACH_BYTES)
    if fused_available() is None:
        out["torch fused"] = (torch.optim.AdamW(params, lr=lr, fused=True).step, FUSED_BYTES)
    return out


def bench(n, tensors, threads, repeats):
    torch.set_num_threads(threads)
    flat = torch.randn(n)
    # views of the flat buffer: contiguous
    params = [torch.nn.Parameter(t) for t in flat.chunk(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opts = optimizers(params)
    times = interleaved(opts, repeats)
    return times, {name: nbytes for name, (_, nbytes) in opts.items()}


CLIP = 0.37  # the clip coefficient of the offload step (any value < 1: the gradient is scaled)
OFFLOAD_BYTES = dict(
    kernel=FUSED_BYTES + 2,
    fused=8 + FUSED_BYTES + 6,
    scaled=FUSED_BYTES + 4 + 6,
    # + grad *= c (8), + the bf16 cast (4 read, 2 written)
    foreach=8 + FOREACH_BYTES + 6,
)


def offload_steps(params, out, lr=1e-3):
    """ZeRO-Offload's host step of a bf16 model (nanomega/offload.py): the gradient times the clip
    coefficient, AdamW, the new weights rounded to bf16 for the upload. name -> (step function,
    bytes per element)."""

    def kernel(opt):
        def step():
            for p, o in zip(params, out):
                state = opt.state[p]
                if not state:
                    state.update(
                        step=torch.tensor(0.0),
                        exp_avg=torch.zeros_like(p),
                        exp_avg_sq=torch.zeros_like(p),
                    )
                state["step"] += 1
                cpu_adam.adam_step(
                    p.data,
                    p.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    lr=lr,
                    beta1=0.9,
                    beta2=0.999,
                    eps=1e-8,
                    weight_decay=1e-2,
                    step=state["step"].item(),
                    grad_scale=CLIP,
                    out=o,
                )

        return step

    def separate(opt):  # torch's pieces, one pass each: the scaling, the optimizer, the cast
        def step():
            torch._foreach_mul_([p.grad for p in params], CLIP)
            opt.step()
            torch._foreach_copy_(out, [p.detach() for p in params])

        return step

    # the scaling inside torch's fused pass (GradScaler's hook: it divides by grad_scale)
    def grad_scale(opt):
        opt.grad_scale, opt.found_inf = torch.tensor(1 / CLIP), torch.tensor(0.0)

        def step():
            opt.step()
            torch._foreach_copy_(out, [p.detach() for p in params])

        return step

    steps = {
        "CPUAdamW, one pass": (kernel(cpu_adam.CPUAdamW(params, lr=lr)), OFFLOAD_BYTES["kernel"]),
        "torch foreach: grad *= c; step; cast": (
            separate(torch.optim.AdamW(params, lr=lr, foreach=True)),
            OFFLOAD_BYTES["foreach"],
        ),
    }
    if fused_available() is None:
        steps["torch fused: grad *= c; step; cast"] = (
            separate(torch.optim.AdamW(params, lr=lr, fused=True)),
            OFFLOAD_BYTES["fused"],
        )
        steps["torch fused(grad_scale=1/c); cast"] = (
            grad_scale(torch.optim.AdamW(params, lr=lr, fused=True)),
            OFFLOAD_BYTES["scaled"],
        )
    return steps


def bench_offload(n, tensors, threads, repeats):
    torch.set_num_threads(threads)
    params = [torch.nn.Parameter(t) for t in torch.randn(n).chunk(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    out = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    opts = offload_steps(params, out)
    return interleaved(opts, repeats), {name: nbytes for name, (_, nbytes) in opts.items()}


def interleaved(opts, repeats):
    """Each step once untimed (state allocated, pages touched, threads started), then all of them in
    turn."""
    for step, _ in opts.values():
        step()
    times = {name: [] for name in opts}
    for _ in range(repeats):
        for name, (step, _) in opts.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return times


def table(n, threads, times, nbytes):
    ours = min(next(iter(times.values())))  # CPUAdamW on the path it takes by default
    for name, ts in times.items():
        best = min(ts)
        print(
            f"| {name} | {threads} | {1e3 * best:.1f} | {1e3 * statistics.median(ts):.1f} | "
            f"{nbytes[name] * n / best / 1e9:.1f} | {best / ours:.2f}x |",
            flush=True,
        )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--tensors", type=int, default=1)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    n = int(args.params)
    print(
        f"{datetime.date.today()} | {extension.cpu_summary()} | torch {torch.__version__} | CPUAdamW path: "
        f"{cpu_adam.isa()} (this CPU runs {', '.join(cpu_adam.isas()) or 'none: no extension'})"
    )
    reason = fused_available()
    print(
        f"torch.optim.AdamW(fused=True) on CPU: {'available' if reason is None else 'not available: ' + reason}"
    )
    print(
        f"{n:,} fp32 parameters in {args.tensors} tensor(s); load average before: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    offload = (
        f"\nZeRO-Offload's host step of a bf16 model (offload.py): the gradient x clip coefficient {CLIP}, "
        f"AdamW, the new weights rounded to bf16 for the upload"
    )
    for title, run in (("\n| optimizer", bench), (offload + "\n| host step", bench_offload)):
        print(f"{title} | threads | min ms | median ms | GB/s (min) | time / CPUAdamW's (min) |")
        print("|---|---|---|---|---|---|")
        for threads in args.threads:
            table(n, threads, *run(n, args.tensors, threads, args.repeats))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
