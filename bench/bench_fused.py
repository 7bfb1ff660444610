"""Fused C++ ops vs eager PyTorch vs torch.compile: forward + backward time on CPU, same shapes, one
run.

    python bench/bench_fused.py                 # all ops, threads 1 and 2, 20 repeats
    python bench/bench_fused.py --threads 1 --repeats 5
    python bench/bench_fused.py --ops llama --no-compile   # RMSNorm and SwiGLU only, eager vs fused

Each timed step is forward + backward of one op: bias-GeLU, softmax and LayerNorm at a GPT-2-small
layer's shape (b=8, s=256, h=768, 12 heads), RMSNorm and SwiGLU at a TinyLlama-1.1B layer's (h=2048,
f=5632) for b=4, s=256. The implementations run interleaved, repeat after repeat, so background load
hits them alike; the table shows the minimum over repeats (the least disturbed run), the ratios to
fused, and each implementation's bandwidth: the fp32 bytes it moves (nanomega/fused.py's formulas:
eager's own traffic, intermediates included, and fused's) over its time, next to a plain copy's at
the same thread count. Cheap ops get more repeats (as many as fit in ~2 s, at most 200): a short op
needs more tries to meet a quiet moment.
Targets (issue 7): fused >= 1.5x eager for bias-GeLU and softmax, and not slower than torch.compile.
Lesson: lessons/13-fused-kernels.md
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanomega import extension, fused, model, modern  # noqa: E402

B, S, H, N_HEAD = 8, 256, 768, 12
SCALE = (H // N_HEAD) ** -0.5
# b * s tokens; TinyLlama-1.1B's hidden and MLP widths
LLAMA_ROWS, LLAMA_H, LLAMA_F = 4 * 256, 2048, 5632


def cases():
    """name -> (make inputs, eager fn, fused fn)."""
    return {
        f"bias_gelu ({B * S}, {4 * H})": (
            lambda: [torch.randn(B * S, 4 * H), torch.randn(4 * H)],
            model.bias_gelu,
            fused.bias_gelu,
        ),
        f"causal_softmax ({B}, {N_HEAD}, {S}, {S})": (
            lambda: [torch.randn(B, N_HEAD, S, S)],
            lambda s: model.causal_softmax(s, SCALE),
            lambda s: fused.causal_softmax(s, SCALE),
        ),
        f"layer_norm ({B * S}, {H})": (
            lambda: [torch.randn(B * S, H), torch.randn(H), torch.randn(H)],
            lambda x, w, b: F.layer_norm(x, (H,), w, b, 1e-5),
            lambda x, w, b: fused.layer_norm(x, w, b, 1e-5),
        ),
    }


def llama_cases():
    """name -> (make inputs, eager fn, fused fn) for the Llama block's RMSNorm and SwiGLU."""
    R, h, f = LLAMA_ROWS, LLAMA_H, LLAMA_F
    return {
        f"rms_norm ({R}, {h})": (
            lambda: [torch.randn(R, h), torch.randn(h)],
            lambda x, w: modern.rms_norm(x, w, 1e-5),
            lambda x, w: fused.rms_norm(x, w, 1e-5),
        ),
        f"swiglu ({R}, {2 * f})": (lambda: [torch.randn(R, 2 * f)], modern.swiglu, fused.swiglu),
    }


OPS = {"gpt2": cases, "llama": llama_cases}


def traffic(name):
    """(eager, fused) fp32 bytes one forward + backward of `name` moves: nanomega/fused.py's element
    counts, the per-row and per-column terms (rstd, bias, weight: < 0.1% here) left out."""
    op = name.split()[0]
    n = {
        "bias_gelu": B * S * 4 * H,
        "causal_softmax": B * N_HEAD * S * S,
        "layer_norm": B * S * H,
        # SwiGLU: n = output elements
        "rms_norm": LLAMA_ROWS * LLAMA_H,
        "swiglu": LLAMA_ROWS * LLAMA_F,
    }[op]
    visible = B * N_HEAD * S * (S + 1) // 2
    eager, fast = {
        "bias_gelu": (8 * n, 5 * n),
        "causal_softmax": (13 * n, 3 * visible + 2 * n),
        "layer_norm": (5 * n, 5 * n),
        "rms_norm": (30 * n, 5 * n),
        "swiglu": (18 * n, 8 * n),
    }[op]
    return 4 * eager, 4 * fast


def copy_bandwidth():
    """Read + write bytes per second of a 256 MiB copy (beyond any L3), the best of 5."""
    src, dst = torch.randn(64 * 2**20), torch.empty(64 * 2**20)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def step(fn, inputs, grad):
    """One forward + backward; returns seconds."""
    for t in inputs:
        t.grad = None
    t0 = time.perf_counter()
    fn(*inputs).backward(grad)
    return time.perf_counter() - t0


def compiled(fn, inputs, grad):
    """torch.compile(fn) warmed up (compiles forward and backward), its compile seconds, or its
    error."""
    try:
        t0 = time.perf_counter()
        c = torch.compile(fn)
        step(c, inputs, grad)
        return c, time.perf_counter() - t0, None
    except Exception as e:  # no C++ compiler for inductor, unsupported platform, ...
        return None, 0.0, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"


def run(threads, repeats, ops=("gpt2",), compile=True, budget_s=2.0):
    """Rows of (op, threads, best ms per implementation, compile seconds, compile error): the
    minimum of at least `repeats` timed steps, more while they fit in budget_s per op (cheap ops:
    more tries at a quiet moment)."""
    torch.set_num_threads(threads)
    # inductor bakes the thread count into its kernels: compile again per count
    torch._dynamo.reset()
    rows = []
    for name, (make, eager, fast) in {k: v for op in ops for k, v in OPS[op]().items()}.items():
        torch.manual_seed(0)
        inputs = [t.requires_grad_() for t in make()]
        grad = torch.randn_like(eager(*inputs))
        impls = {"eager": eager, "fused": fast}
        comp, comp_s, err = compiled(eager, inputs, grad) if compile else (None, 0.0, None)
        if comp is not None:
            impls["compile"] = comp
        times = {k: [] for k in impls}
        for _ in range(2):  # warm-up: caches, allocator, OpenMP pool
            warm = max(step(fn, inputs, grad) for fn in impls.values())
        for _ in range(min(200, max(repeats, int(budget_s / warm)))):
            for k, fn in impls.items():
                times[k].append(step(fn, inputs, grad))
        best = {k: min(v) * 1e3 for k, v in times.items()}
        rows.append((name, threads, best, comp_s, err))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument(
        "--ops",
        nargs="+",
        choices=sorted(OPS),
        default=["gpt2", "llama"],
        help="gpt2: bias-GeLU, causal softmax, LayerNorm; llama: RMSNorm, SwiGLU",
    )
    p.add_argument(
        "--no-compile", action="store_true", help="eager vs fused only (no torch.compile column)"
    )
    args = p.parse_args()
    t0 = time.perf_counter()
    if not extension.available():
        sys.exit("bench_fused: the fused kernels did not build (see the notice above)")
    print(
        f"extension ready in {time.perf_counter() - t0:.2f} s (cached build in {extension.build_dir()})"
    )
    print(f"CPU {extension.cpu_summary()}")
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"min of >= {args.repeats} repeats, forward + backward, fp32\n"
    )
    print(
        "| op (shape) | threads | eager ms | torch.compile ms | fused ms | eager / fused | compile / fused "
        "| eager GB/s | fused GB/s | copy GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for threads in args.threads:
        for name, t, best, comp_s, err in run(threads, args.repeats, args.ops, not args.no_compile):
            c = best.get("compile")
            comp_cols = (f"{c:.2f}", f"{c / best['fused']:.2f}x") if c else ("n/a", "n/a")
            eager_bytes, fused_bytes = traffic(name)
            print(
                f"| {name} | {t} | {best['eager']:.2f} | {comp_cols[0]} | {best['fused']:.2f} | "
                f"{best['eager'] / best['fused']:.2f}x | {comp_cols[1]} | {eager_bytes / best['eager'] / 1e6:.1f} | "
                f"{fused_bytes / best['fused'] / 1e6:.1f} | {copy_bandwidth() / 1e9:.1f} |",
                flush=True,
            )
            if err:
                errors.append(f"torch.compile failed for {name}: {err}")
            elif comp_s:
                errors.append(f"torch.compile of {name}, {t} thread(s): {comp_s:.1f} s to compile")
    print("\n" + "\n".join(errors))


if __name__ == "__main__":
    main()
