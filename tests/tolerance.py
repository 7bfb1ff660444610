"""Tolerances from the arithmetic: the one home of the suite's rounding-error bounds.

Two computations of the same math in floating point (a fused kernel and PyTorch, a sharded model and
the dense one) round differently, and how differently depends on the CPU: an AVX2 and an AVX-512
machine sum in other vector widths and run other BLAS kernels. So a tolerance is never what one CPU
happened to give; it is a bound derived from the arithmetic, written where it is used in these
terms:

    u           unit roundoff of a dtype: 2^-24 fp32, 2^-8 bf16, 2^-11 fp16, 2^-53 fp64
    gamma(n)    n u / (1 - n u): summing n terms in ANY order errs by at most gamma(n) * sum |terms|
                (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., Lemma 3.1); two orders
                of the same sum differ by at most 2 gamma(n) * sum |terms|
    likely(n)   LAMBDA sqrt(n) u: the same, with rounding errors treated as independent and zero-mean
                (Higham & Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci.
                Comput. 2019): it fails with probability about 2 n exp(-LAMBDA^2 / 2) (< 1e-9 for n < 10^5)

Worst-case gamma(n) is used where n is small or a kernel's error is deterministic (an exp with a
stated ulp error); likely(n) where long sums would make gamma(n) too loose to catch a real bug.
Bitwise equality is asserted only where the math guarantees it: the same kernel, the same shapes,
the same reduction order.
"""

import math

import torch

LAMBDA = 8.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of rounding one real number to dtype."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Worst-case relative error (to sum |terms|) of an n-term sum in any order (Higham, Lemma
    3.1)."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"gamma({n}) undefined for {dtype}"
    return nu / (1 - nu)


def likely(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Probabilistic relative error (to sum |terms|) of an n-term sum (Higham & Mary 2019, LAMBDA =
    8)."""
    return LAMBDA * math.sqrt(n) * unit_roundoff(dtype)


def layout_rtol(steps: int, vocab: int, width: int, depth: int, min_loss: float = 4.0) -> float:
    """Relative loss difference allowed between two layouts (tp/pp/dp/ZeRO) of one fp32 training
    run.
    A layout changes only the order of sums. At step 1: the cross-entropy's logsumexp over `vocab`
    positive terms (2 likely(vocab) relative to the sum: absolute on the loss) plus `depth`
    reductions of <= `width` terms before it (2 likely(width) sqrt(depth) relative to logits of size
    < 1; at most twice that on the loss). AdamW passes relative differences on unamplified
    (tests/test_tp.py), so by step k the difference is <= k times step 1's; relative to losses that
    stay above `min_loss`."""
    return steps * (2 * likely(vocab) + 4 * likely(width) * depth**0.5) / min_loss


def gradient_rtol(tokens: int, vocab: int, width: int, depth: int, n_params: int) -> float:
    """Relative error, to an element's sum of |terms|, between two layouts' fp32 gradients of the
    same weights and batch (a layout changes only the order of sums). An element sums `tokens`
    products (2 likely(tokens) for two orders); each product's factors come through the forward's
    and the backward's `depth` reductions of <= `width` terms (4 likely(width) sqrt(2 depth), as
    layout_rtol's forward alone) from the softmax over `vocab` logits (2 likely(vocab)); a clipped
    gradient's coefficient, c / ||g|| over `n_params` squares, adds likely(n_params)."""
    chains = 4 * likely(width) * (2 * depth) ** 0.5
    return 2 * likely(tokens) + 2 * likely(vocab) + chains + likely(n_params)


def gradient_bound(grads: dict, tokens: int, rtol: float) -> dict:
    """{name: elementwise bound on |g' - g|} for a layout's gradients g' against grads (fp32):
    rtol (|g| + sqrt(tokens) rms), the rms over every element of grads. An element's sum of |terms|
    is not known here: where its terms share a sign it is |g|; where they cancel (a random walk:
    the independence likely() assumes) it is about sqrt(tokens) times a typical |g|. The whole
    model's rms is that typical |g|: a gradient that is zero in exact arithmetic (a key's bias:
    softmax ignores a shift shared by every key) is its own rounding, not its terms' scale."""
    every = torch.cat([g.reshape(-1).double() for g in grads.values()])
    floor = tokens**0.5 * every.square().mean().sqrt().item()
    return {k: rtol * (g.double().abs() + floor) for k, g in grads.items()}


def adam_first_step_bound(g, bound, w, lr: float, eps: float = 1e-8):
    """Elementwise bound on |w1' - w1|: two runs' first AdamW step from the same weights, with
    gradients |g' - g| <= bound (w: the weights after the step). Step 1 moves a weight by
    lr phi(g), phi(x) = x / (|x| + eps) (m-hat = g, sqrt(v-hat) = |g|), after the same decay: phi is
    1/eps-Lipschitz and within 2 of itself anywhere, and for one sign it differs by at most
    eps |g - g'| / ((|g| - bound) + eps)^2, so wherever the sign is certain (|g| > bound) the steps
    agree to that, a fraction of a rounding; where it is not, by up to 2 lr. Plus the two steps'
    rounding: the decay and the add (2u |w| each), Adam's ratio (a few u of lr, 16u in all)."""
    u = unit_roundoff(torch.float32)
    margin = (g.double().abs() - bound).clamp_min(0)
    phi = (eps * bound / (margin + eps) ** 2).clamp_max(2)
    return lr * phi + 4 * u * w.double().abs() + 16 * u * lr


def assert_within(got: torch.Tensor, want: torch.Tensor, bound, what: str = "") -> float:
    """|got - want| <= bound elementwise (bound: a number or a tensor broadcast to want, from the
    arithmetic); returns the largest ratio |got - want| / bound so callers can report the margin."""
    diff = (got.detach().double() - want.detach().double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff)
    worst = (diff / bound.clamp_min(1e-300)).max().item() if diff.numel() else 0.0
    assert (diff <= bound).all(), (
        f"{what}: |got - want| up to {diff.max().item():.3g} exceeds the bound "
        f"from the arithmetic ({worst:.3g}x it)"
    )
    return worst
