"""Fused C++ ops vs eager PyTorch vs torch.compile: forward + backward time on CPU, same shapes, one run.

    python bench/bench_fused.py                 # threads 1 and 2, 20 repeats
    python bench/bench_fused.py --threads 1 --repeats 5

Each timed step is forward + backward of one op at a GPT-2-small layer's shape (b=8, s=256, h=768,
12 heads). The three implementations run interleaved, repeat after repeat, so background load hits them
alike; the table shows the minimum over repeats (the least disturbed run) and the ratios to fused. Cheap
ops get more repeats (as many as fit in ~2 s, at most 200): a short op needs more tries to meet a quiet moment.
Targets (issue 7): fused >= 1.5x eager for bias-GeLU and softmax, and not slower than torch.compile.
Lesson: lessons/08-fused-kernels.md
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanomega import fused, model  # noqa: E402

B, S, H, N_HEAD = 8, 256, 768, 12
SCALE = (H // N_HEAD) ** -0.5


def cases():
    """name -> (make inputs, eager fn, fused fn)."""
    return {
        f"bias_gelu ({B * S}, {4 * H})": (lambda: [torch.randn(B * S, 4 * H), torch.randn(4 * H)],
                                          model.bias_gelu, fused.bias_gelu),
        f"causal_softmax ({B}, {N_HEAD}, {S}, {S})": (lambda: [torch.randn(B, N_HEAD, S, S)],
                                                      lambda s: model.causal_softmax(s, SCALE),
                                                      lambda s: fused.causal_softmax(s, SCALE)),
        f"layer_norm ({B * S}, {H})": (lambda: [torch.randn(B * S, H), torch.randn(H), torch.randn(H)],
                                       lambda x, w, b: F.layer_norm(x, (H,), w, b, 1e-5),
                                       lambda x, w, b: fused.layer_norm(x, w, b, 1e-5)),
    }


def step(fn, inputs, grad):
    """One forward + backward; returns seconds."""
    for t in inputs:
        t.grad = None
    t0 = time.perf_counter()
    fn(*inputs).backward(grad)
    return time.perf_counter() - t0


def compiled(fn, inputs, grad):
    """torch.compile(fn) warmed up (compiles forward and backward), its compile seconds, or its error."""
    try:
        t0 = time.perf_counter()
        c = torch.compile(fn)
        step(c, inputs, grad)
        return c, time.perf_counter() - t0, None
    except Exception as e:  # no C++ compiler for inductor, unsupported platform, ...
        return None, 0.0, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"


def run(threads, repeats):
    torch.set_num_threads(threads)
    torch._dynamo.reset()  # inductor bakes the thread count into its kernels: compile again per count
    rows = []
    for name, (make, eager, fast) in cases().items():
        torch.manual_seed(0)
        inputs = [t.requires_grad_() for t in make()]
        grad = torch.randn_like(eager(*inputs))
        impls = {"eager": eager, "fused": fast}
        comp, comp_s, err = compiled(eager, inputs, grad)
        if comp is not None:
            impls["compile"] = comp
        times = {k: [] for k in impls}
        for _ in range(2):  # warm-up: caches, allocator, OpenMP pool
            warm = max(step(fn, inputs, grad) for fn in impls.values())
        for _ in range(min(200, max(repeats, int(2.0 / warm)))):  # cheap ops: more tries at a quiet moment
            for k, fn in impls.items():
                times[k].append(step(fn, inputs, grad))
        best = {k: min(v) * 1e3 for k, v in times.items()}
        rows.append((name, threads, best, comp_s, err))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    t0 = time.perf_counter()
    if not fused.available():
        sys.exit("bench_fused: the fused kernels did not build (see the notice above)")
    print(f"extension ready in {time.perf_counter() - t0:.2f} s (cached build in {fused.build_dir()})")
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"min of >= {args.repeats} repeats, forward + backward\n")
    print("| op (shape) | threads | eager ms | torch.compile ms | fused ms | eager / fused | compile / fused |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for threads in args.threads:
        for name, t, best, comp_s, err in run(threads, args.repeats):
            c = best.get("compile")
            comp_cols = (f"{c:.2f}", f"{c / best['fused']:.2f}x") if c else ("n/a", "n/a")
            print(f"| {name} | {t} | {best['eager']:.2f} | {comp_cols[0]} | {best['fused']:.2f} | "
                  f"{best['eager'] / best['fused']:.2f}x | {comp_cols[1]} |", flush=True)
            if err:
                errors.append(f"torch.compile failed for {name}: {err}")
            elif comp_s:
                errors.append(f"torch.compile of {name}, {t} thread(s): {comp_s:.1f} s to compile")
    print("\n" + "\n".join(errors))


if __name__ == "__main__":
    main()
