"""Lesson 13 experiment: bytes moved by eager ops (counted), then fused vs eager vs torch.compile
(timed).

    python lessons/13_fused.py

Counts the bytes every eager aten kernel reads and writes during forward + backward of bias-GeLU,
causal softmax and LayerNorm (a TorchDispatchMode sees each kernel and its tensors) and checks them
against the formulas of nanomega/fused.py. Then times the three implementations on one thread and
compares the rate at which the fused kernels move their bytes with a plain copy's bandwidth.
"""

import os
import sys
import time

# no compile-worker pool: faster cold start
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]
from bench_fused import B, H, N_HEAD, S, SCALE, run  # noqa: E402
from check import check  # noqa: E402

from nanomega import extension, fused, model  # noqa: E402


class ByteCounter(TorchDispatchMode):
    """Sum of the sizes of every tensor each aten kernel reads or writes: its memory traffic if each
    input is read once and each output written once (views move nothing and are skipped)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            leaves = pytree.tree_leaves((args, kwargs, out))
            self.bytes += sum(
                t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)
            )
        return out


def eager_bytes(fn, *shapes):
    inputs = [torch.randn(s, requires_grad=True) for s in shapes]
    grad = torch.ones(shapes[0])  # each op's output has its first input's shape
    with ByteCounter() as counter:
        fn(*inputs).backward(grad)
    return counter.bytes


def max_diff(fn_a, fn_b, *shapes):
    """max |a - b| / max |b|: the two computations' difference relative to the output's size."""
    torch.manual_seed(0)
    inputs = [torch.randn(s) for s in shapes]
    b = fn_b(*inputs)
    return ((fn_a(*inputs) - b).abs().max() / b.abs().max()).item()


def rounding_budget(n):
    """How far two fp32 kernels of these ops may differ, relative: each errs by <= 64 u (at::vec's
    exp_u20, 20 ulp = 40 u, plus a dozen roundings) + 8 sqrt(n) u for a row sum of n terms
    (tests/tolerance.py)."""
    return 2 * (64 + 8 * n**0.5) * 2.0**-24


def machine():
    """Copy bandwidth (read + write bytes / s) and fp32 matmul FLOP/s on one thread."""
    # 256 MiB: beyond any L3
    src, dst = torch.randn(256 * 2**20 // 4), torch.zeros(256 * 2**20 // 4)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    bw, flops = 0.0, 0.0
    for _ in range(5):  # the best of 5: the machine may be shared
        t = time.perf_counter()
        dst.copy_(src)
        bw = max(bw, 2 * src.numel() * 4 / (time.perf_counter() - t))
        t = time.perf_counter()
        a @ b
        flops = max(flops, 2 * 1024**3 / (time.perf_counter() - t))
    return bw, flops


def main():
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    assert extension.available(), "the fused kernels did not build (see the notice above)"
    print(
        f"extension ready in {time.perf_counter() - t0:.2f} s (build cache {extension.build_dir()})"
    )

    N = B * S  # rows of the (b*s, h) activations
    n_mlp, n_att, n_ln = N * 4 * H, B * N_HEAD * S * S, N * H
    visible = B * N_HEAD * S * (S + 1) // 2  # keys a causal row really reads
    # eager traffic, counted: bias-GeLU: add 2n + gelu 2n | gelu_backward 3n + bias sum n (+2h bias)
    check(
        "eager bias+GeLU fwd+bwd bytes (counted per aten kernel) vs 4(8n + 2h)",
        eager_bytes(model.bias_gelu, (N, 4 * H), (4 * H,)),
        4 * (8 * n_mlp + 2 * 4 * H),
    )
    # scale 2n, mask 2n, softmax 2n | softmax_backward 3n, mask 2n, scale 2n; bool mask: 5 s^2 bytes
    check(
        "eager causal softmax fwd+bwd bytes vs 4(13n) + 5s^2",
        eager_bytes(lambda s: model.causal_softmax(s, SCALE), (B, N_HEAD, S, S)),
        4 * 13 * n_att + 5 * S * S,
    )
    # PyTorch's LayerNorm is one kernel each way already: 2n | 3n, plus mean/rstd (2 per row) and w,
    # b
    check(
        "eager LayerNorm fwd+bwd bytes vs 4(5n + 4 rows + 6h)",
        eager_bytes(lambda x, w, b: F.layer_norm(x, (H,), w, b), (N, H), (H,), (H,)),
        4 * (5 * n_ln + 4 * N + 6 * H),
    )
    fused_bytes = {
        "bias_gelu": 4 * 5 * n_mlp,
        "causal_softmax": 4 * (3 * visible + 2 * n_att),
        "layer_norm": 4 * 5 * n_ln,
    }
    print(
        f"fused traffic (formula): bias+GeLU 5n -> {8 / 5:.2f}x less; causal softmax 3 visible + 2n "
        f"-> {4 * 13 * n_att / fused_bytes['causal_softmax']:.2f}x less; LayerNorm 5n -> 1.00x"
    )

    ok = max_diff(fused.bias_gelu, model.bias_gelu, (N, 4 * H), (4 * H,)) <= rounding_budget(1)
    check("fused bias+GeLU == eager within the rounding budget (1 = yes)", int(ok), 1)
    ok = max_diff(
        lambda s: fused.causal_softmax(s, SCALE),
        lambda s: model.causal_softmax(s, SCALE),
        (B, N_HEAD, S, S),
    ) <= rounding_budget(S)
    check("fused causal softmax == eager within the rounding budget (1 = yes)", int(ok), 1)

    bw, flops = machine()
    print(
        f"this CPU, 1 thread: copy {bw / 1e9:.1f} GB/s, matmul {flops / 1e9:.0f} GFLOP/s -> machine balance "
        f"{flops / bw:.0f} FLOP/byte; these ops do ~1-3 FLOP/byte: memory-bound"
    )
    # tests/test_lessons.py sets NANOMEGA_QUICK_TIMING=1: the same code, each timing taken once
    # (printed, never asserted: the checks above are what the test compares with this lesson)
    repeats, budget_s = (1, 0.0) if os.environ.get("NANOMEGA_QUICK_TIMING") == "1" else (5, 2.0)
    print(
        f"\nforward + backward, 1 thread, min of >= {repeats} repeats (timings vary from run to run):"
    )
    for name, _, best, _comp_s, err in run(threads=1, repeats=repeats, budget_s=budget_s):
        rate = fused_bytes[name.split()[0]] / best["fused"] / 1e6  # GB/s: bytes / ms / 1e6
        comp = f"compile {best['compile']:6.2f} ms" if "compile" in best else f"compile n/a ({err})"
        print(
            f"  {name:34s} eager {best['eager']:6.2f} ms  {comp}  fused {best['fused']:6.2f} ms "
            f"({best['eager'] / best['fused']:.1f}x eager; moves its bytes at {rate:.1f} GB/s)"
        )


if __name__ == "__main__":
    main()
