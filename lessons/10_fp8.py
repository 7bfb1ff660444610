"""Lesson 10: FP8 training. The formats' ranges and spacing from their bits, then one GEMM's error
under each recipe with and without an outlier channel (the divergence lab's mechanism).

    python lessons/10_fp8.py
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanomega import fp8  # noqa: E402
from nanomega.fp8_linear import FP8  # noqa: E402


def check(what, compared, ok):
    """A check line that prints what it compares (compared: the values, and the rule they meet)."""
    print(f"check {what}: {compared} -> {'OK' if ok else 'MISMATCH'}")


# 1. the formats: max = (2 - 2^-m') 2^emax, smallest normal 2^(1-bias), smallest subnormal
# 2^(1-bias-m), spacing at 1 = 2^-m (E4M3fn gives up inf: its top code is a normal number)
for fmt, m, bias, top in [(fp8.E4M3, 3, 7, 1.75 * 2**8), (fp8.E5M2, 2, 15, 1.75 * 2**15)]:
    info = torch.finfo(fmt)
    sub = torch.tensor(2.0 ** (1 - bias - m)).to(fmt).float().item()
    print(f"{str(fmt):22} max {info.max:>8g}  normal >= {info.tiny:.3g}  subnormal >= {sub:.3g}")
    measured = (info.max, info.tiny, info.eps, sub)
    formula = (top, 2.0 ** (1 - bias), 2.0**-m, 2.0 ** (1 - bias - m))
    shown = ", ".join(f"{v:g}" for v in measured)
    check(
        f"{str(fmt).split('.')[1]} (max, smallest normal, spacing at 1, smallest subnormal)",
        f"measured ({shown}), formula (1.75 x 2^{math.log2(top / 1.75):g}, 2^{1 - bias}, 2^-{m}, "
        f"2^{1 - bias - m})",
        measured == formula,
    )

# 2. the activations X (256 tokens, 256 channels) quantized as each recipe's forward GEMM does;
# then channel 0 made 2^k times larger (LLMs grow such channels: Dettmers et al. 2022). Measured:
# the error of the other 255 channels, ||q(X)[:, 1:] - X[:, 1:]|| / ||X[:, 1:]||
x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
print(f"{'recipe':12} " + " ".join(f"{'x 2^' + str(k):>9}" for k in (0, 8, 12, 16)))
errors = {}
for name in ["tensorwise", "rowwise", "blockwise", "mxfp8"]:
    entry = FP8(name, block=32)
    errors[name] = []
    for k in (0, 8, 12, 16):
        xo = x.clone()
        xo[:, 0] *= 2.0**k
        rest = entry.operand(xo, "x", None).dequantize()[:, 1:]
        errors[name].append(((rest - x[:, 1:]).norm() / x[:, 1:].norm()).item())
    print(f"{name:12} " + " ".join(f"{e:9.4f}" for e in errors[name]))
ratio = {n: e[3] / e[0] for n, e in errors.items()}  # error at 2^16 / error without the outlier
check(
    "a 2^16 outlier: tensorwise and rowwise err > 4x more",
    f"tensorwise {ratio['tensorwise']:.1f}x, rowwise {ratio['rowwise']:.1f}x",
    ratio["tensorwise"] > 4 < ratio["rowwise"],
)
check(
    "a 2^16 outlier: blockwise and mxfp8 err < 2x more",
    f"blockwise {ratio['blockwise']:.1f}x, mxfp8 {ratio['mxfp8']:.1f}x",
    ratio["blockwise"] < 2 > ratio["mxfp8"],
)
worst = max(errors, key=lambda n: errors[n][2] / errors[n][0])
check(
    "a 2^12 outlier: every recipe err < 1.1x more",
    f"the most, {worst} {errors[worst][2] / errors[worst][0]:.2f}x",
    all(e[2] < 1.1 * e[0] for e in errors.values()),
)
