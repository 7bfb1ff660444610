"""CPU Adam/AdamW in one fused C++ pass over flat fp32 buffers (DeepSpeed's cpu_adam): the host step
of ZeRO-Offload.

Idea: ZeRO-Offload (Ren et al. 2021) keeps the fp32 master weights and Adam's m and v in host memory
and runs the optimizer step on the CPU. That step is memory-bound: 14 operations per element against
28 bytes. PyTorch's for-loop and foreach AdamW run one elementwise kernel per line of the formula,
each a full pass over memory; csrc/cpu_adam.cpp reads param, grad, m and v once and writes param, m
and v once, on every thread (OpenMP), 16 floats per instruction where the CPU has AVX-512 (8 with
AVX2; a scalar loop elsewhere), the path picked at run time (isa()). Without a compiler the same
arithmetic runs as PyTorch ops (reference_step).

Formula (torch.optim.AdamW's; step t counts from 1; every element on its own):
    p <- p (1 - lr wd)                                   decoupled weight decay (AdamW)
    m <- b1 m + (1 - b1) g
    v <- b2 v + (1 - b2) g^2
    p <- p - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
  decoupled_weight_decay=False is torch.optim.Adam's instead: g <- g + wd p first, no decay of p.
Bytes per element and step (fp32): fused 16 read + 12 written = 28. torch's for-loop and foreach
paths 80:
  p*=(8) m.lerp_(g)(12) v*=(8) v.addcmul_(g,g)(12) sqrt(8) /bc2(8) +eps(8) p.addcdiv_(m,denom)(16);
  torch's fused=True (on the CPU in this project's torch 2.13) is one pass too: 28, the same memory floor.
  ZeRO-Offload's host step (offload.py) also scales the gradient by the clip coefficient and rounds the new
  weights to bf16 for the upload: inside this pass (adam_step's grad_scale, out) 30 bytes; as passes of their
  own around any optimizer 28 + 8 + 6 = 42 -- where the kernel beats torch's fused one (bench/RESULTS.md).
Rounding: the kernel rounds after every +, -, *, / and sqrt, in the order reference_step writes them
as PyTorch ops, so the two agree to the bit on every ISA path; torch.optim.AdamW orders the same
math otherwise (lerp, addcmul, addcdiv) and agrees within a few roundings per step
(tests/test_cpu_adam.py derives the bound).
State: torch.optim.AdamW's keys and shapes (step: a 0-d fp32 tensor, exp_avg, exp_avg_sq like p), so
an optimizer state dict loads into either. Parameters: contiguous fp32 CPU tensors (ZeroEngine's
host masters).
Lesson: the ZeRO-Offload lesson is issue 32's; the fused-kernel idea is lessons/13-fused-kernels.md.
"""

import torch

from . import extension


def isas() -> list:
    """The kernel's paths this CPU executes, fastest first (e.g. ["avx512", "avx2", "scalar"]); []
    without the extension."""
    ext = extension.extension()
    return ext.adam_isas() if ext is not None else []


def isa(forced: str = "") -> str:
    """The path a step takes here: "avx512", "avx2" or "scalar" -- the fastest this CPU runs, unless
    `forced` or $NANOMEGA_ADAM_ISA names another it runs -- or "pytorch" when the extension cannot
    be built."""
    ext = extension.extension()
    return ext.adam_isa(forced) if ext is not None else "pytorch"


def coefficients(lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0) -> dict:
    """The step's scalars as the kernel forms them: in double (Python floats, as torch.optim.AdamW
    forms them), then each rounded to fp32 once, as PyTorch rounds a Python scalar for an op on fp32
    tensors."""
    exact = dict(
        decay=1 - lr * weight_decay,
        l2=weight_decay,
        beta1=beta1,
        one_minus_beta1=1 - beta1,
        beta2=beta2,
        one_minus_beta2=1 - beta2,
        step_size=lr / (1 - beta1**step),
        bc2_sqrt=(1 - beta2**step) ** 0.5,
        eps=eps,
        grad_scale=grad_scale,
    )
    return {k: torch.tensor(v, dtype=torch.float32).item() for k, v in exact.items()}


def sqrt_rounded(v):
    """sqrt of fp32 v rounded to nearest, as IEEE-754 (and the kernel's sqrtps) defines it.
    torch.sqrt on the CPU is not that: it calls MKL's vsSqrt, measured 0.75 ulp off (~17% of
    elements a last bit away) on an AMD EPYC.
    A first guess from fp64, then the exact test: the midpoints between the guess and its fp32
    neighbours have 25 bits, their squares 50, so fp64 compares v with them exactly (and a square
    root never lands on a midpoint)."""
    exact = v.double()  # every fp32 value is an fp64 value
    s = exact.sqrt().float()  # within one fp32 step of the answer (fp64's own error is far smaller)
    up, down = (
        torch.nextafter(s, torch.full_like(s, float("inf"))),
        torch.nextafter(s, torch.zeros_like(s)),
    )
    hi, lo = (s.double() + up.double()) / 2, (s.double() + down.double()) / 2
    s = torch.where(exact > hi * hi, up, s)
    return torch.where(exact < lo * lo, down, s)


@torch.no_grad()
def reference_step(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    decoupled=True,
    grad_scale=1.0,
    out=None,
):
    """One step in place in PyTorch ops, EXACTLY the kernel's arithmetic: each op below is one IEEE
    rounding in fp32 (the scalars are fp32 values already, so no op rounds them again; the square
    root is rounded as IEEE rounds it, which torch.sqrt does not), in the kernel's order.
    grad_scale: the gradient times it first (the clip coefficient; grad itself is not changed); out:
    a bf16 tensor that receives the new param."""
    c = coefficients(lr, beta1, beta2, eps, weight_decay, step, grad_scale)
    p, g = param, grad * c["grad_scale"]  # times 1.0: the same bits

    if decoupled:
        p = param * c["decay"]
    else:
        g = g + c["l2"] * param

    m = c["beta1"] * exp_avg + c["one_minus_beta1"] * g
    v = c["beta2"] * exp_avg_sq + c["one_minus_beta2"] * (g * g)
    denom = sqrt_rounded(v) / c["bc2_sqrt"] + c["eps"]

    # write back: the weights, the moments, and the bf16 copy
    param.copy_(p - (c["step_size"] * m) / denom)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if out is not None:
        out.copy_(param)  # round to nearest even (finite values: the kernel's bits)


def adam_step(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
    decoupled=True,
    isa="",
    grad_scale=1.0,
    out=None,
):
    """One Adam(W) step of one contiguous fp32 CPU tensor and its state, in place: the C++ kernel
    (isa: force a path), or reference_step when the extension cannot be built. -> the path that ran.
    ZeRO-Offload's host step in the same one pass (offload.py): grad_scale, the clip coefficient the
    gradient is multiplied by first; out, a contiguous bf16 CPU tensor like param that receives the
    new weights rounded for the upload. 30 bytes per element instead of 28 + 8 (grad.mul_) + 6
    (out.copy_(param))."""
    ext = extension.extension()
    if ext is None:
        reference_step(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            step=step,
            decoupled=decoupled,
            grad_scale=grad_scale,
            out=out,
        )
        return "pytorch"

    # the C++ kernel
    return ext.adam_step(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        decoupled,
        isa,
        grad_scale,
        out,
    )


def check_param(p, where):
    """One-line ValueError unless p is a contiguous float32 CPU tensor: the kernel walks raw fp32
    memory."""
    if p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous():
        return
    layout = "" if p.is_contiguous() else " non-contiguous"
    raise ValueError(
        f"CPUAdamW: {where} is a {p.device} {p.dtype}{layout} tensor of shape {tuple(p.shape)}; "
        f"CPUAdamW steps contiguous float32 CPU tensors (fp32 masters in host memory); use "
        f"torch.optim.AdamW for others"
    )


class CPUAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (same constructor, param groups and state dict) stepping contiguous fp32
    CPU parameters with the fused kernel. decoupled_weight_decay=False: torch.optim.Adam's update
    (L2 decay). amsgrad, maximize, foreach, fused and capturable are not options: one fused path on
    the CPU."""

    # an element's update reads only that element: ZeroEngine may shard it (zero_rules.check_config)
    elementwise = True

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        *,
        decoupled_weight_decay=True,
    ):
        for name, value, ok in (
            ("lr", lr, lr >= 0),
            ("eps", eps, eps >= 0),
            ("betas[0]", betas[0], 0 <= betas[0] < 1),
            ("betas[1]", betas[1], 0 <= betas[1] < 1),
            ("weight_decay", weight_decay, weight_decay >= 0),
        ):
            if not ok:
                raise ValueError(f"CPUAdamW: invalid {name} {value!r}")

        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        """torch's, refusing a parameter the kernel cannot step before the group joins (one
        line)."""
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        # torch refuses a set (no order); a generator is read once, here
        elif not isinstance(params, set):
            params = list(params)
        for j, p in enumerate(params):  # p, or (name, p) for torch's named parameters
            check_param(
                p[1] if isinstance(p, tuple) else p,
                f"parameter {j} of group {len(self.param_groups)}",
            )
        super().add_param_group(dict(param_group, params=params))

    def __setstate__(self, state):
        super().__setstate__(state)
        # an older torch's AdamW state dict has no decoupled_weight_decay
        for group in self.param_groups:
            group.setdefault("decoupled_weight_decay", True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for i, group in enumerate(self.param_groups):
            # only a loaded torch state dict can bring these
            if group.get("amsgrad") or group.get("maximize"):
                raise ValueError(
                    f"CPUAdamW: group {i} asks for amsgrad or maximize (from a torch.optim state "
                    f"dict?); CPUAdamW has neither: use torch.optim.AdamW"
                )
            beta1, beta2 = group["betas"]
            for j, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse or grad.device.type != "cpu" or grad.dtype != torch.float32:
                    raise ValueError(
                        f"CPUAdamW: the gradient of parameter {j} of group {i} is a {grad.device} "
                        f"{grad.dtype}{' sparse' if grad.is_sparse else ''} tensor; CPUAdamW needs "
                        f"dense float32 CPU gradients"
                    )

                state = self.state[p]
                # as torch.optim.AdamW's for-loop and foreach paths: step a 0-d fp32 CPU tensor
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

                # the step: one pass of the kernel over p and its state
                state["step"] += 1
                adam_step(
                    p,
                    grad.contiguous(),
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    lr=float(group["lr"]),
                    beta1=float(beta1),
                    beta2=float(beta2),
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    step=state["step"].item(),
                    decoupled=group["decoupled_weight_decay"],
                )
        return loss
