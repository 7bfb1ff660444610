"""Mixed precision: compute in 16 bits, keep everything that accumulates in fp32.

Matmuls and activations run in bf16 (or fp16), while the fp32 master weights, the Adam moments, the
gradient accumulation and reduction, the softmax and the loss stay in fp32 (Micikevicius et al.
2018; BLOOM's lesson). This module casts the model, checks the device, scales the loss for fp16, and
holds the arithmetic of the step (fp32_master, unscale_, write_back) that zero.ZeroEngine applies to
its sharded flat buffers, so mixed precision composes with ZeRO, TP and PP unchanged.

    dtype  exponent  mantissa  max      smallest normal  eps (1 ulp at 1)
    fp32   8 bits    23 bits   3.4e38   1.2e-38          1.2e-7
    bf16   8 bits     7 bits   3.4e38   1.2e-38          7.8e-3  <- fp32's range, fewer digits
    fp16   5 bits    10 bits   65504    6.1e-5           9.8e-4  <- overflows, small grads underflow

Bytes per parameter with Adam: 2 (bf16 weight) + 2 (bf16 grad) + 4 (fp32 master) + 4 + 4 (Adam m, v)
= 16; accumulating gradients in fp32 (the bf16 grad is added into an fp32 buffer and dropped) gives
2+4+4+4+4 = 18. fp16's dynamic loss scaling: multiply the loss by S, unscale the fp32 gradients by
1/S, and on inf/nan skip the step and halve S; after `growth_interval` clean steps double S.
Lesson: lessons/09-mixed-precision.md
"""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The --dtype name of a torch dtype: torch.bfloat16 -> "bf16"."""
    return {v: k for k, v in DTYPES.items()}[dtype]


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def check_dtype_supported(dtype: torch.dtype, device) -> None:
    """Raise a one-line error, naming --dtype, if `device` cannot train in `dtype`.

    CUDA: bf16 needs compute capability >= 8.0 (Ampere); fp16 is asked of the device the same
    way. Everywhere (CPU included) a tiny matmul + backward in `dtype` is run as a probe: torch
    2.13 on CPU runs both bf16 and fp16 matmuls (fp16 is slow without AVX512-FP16/AMX-FP16, but
    correct), so on CPU both are allowed; a device or build that lacks the kernels fails the
    probe and gets this error.
    """
    device = torch.device(device)
    if dtype == torch.float32:
        return
    name = dtype_name(dtype)
    fix = (
        "use --dtype bf16 or --dtype fp32"
        if dtype == torch.float16
        else "use --dtype fp32 (or fp16 with loss scaling)"
    )
    if (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise ValueError(
            f"--dtype bf16: {torch.cuda.get_device_name(device)} has no bf16 support (needs sm_80+); {fix}"
        )
    try:
        a = torch.ones(8, 8, dtype=dtype, device=device, requires_grad=True)
        (a @ a).sum().backward()
        ok = a.grad is not None and bool(torch.isfinite(a.grad).all())
    except (RuntimeError, NotImplementedError) as e:
        raise ValueError(
            f"--dtype {name} is not supported on device {device} ({str(e).splitlines()[0]}); {fix}"
        ) from None
    if not ok:
        raise ValueError(f"--dtype {name} gave wrong results on device {device}; {fix}")


def set_tf32(device, enabled: bool = True) -> None:
    """fp32 matmuls on CUDA tensor cores in TF32 (10-bit mantissa inputs, fp32 accumulation): 156
    instead of 19.5 TFLOP/s on an A100. On by default for fp32 training, as in Megatron;
    --no-tf32 turns it off.

    torch >= 2.9 has per-backend settings (fp32_precision "tf32" | "ieee"), and there only they are
    used: the legacy allow_tf32 setters warn on torch 2.9 (on every rank), and mixing the two APIs
    raises on torch 2.13: after this, read torch.backends.cuda.matmul.fp32_precision, not allow_tf32
    or torch.get_float32_matmul_precision(). Older torch: the legacy setters."""
    if torch.device(device).type != "cuda":
        return
    # unknown attribute: AttributeError on old torch
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        mode = "tf32" if enabled else "ieee"
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = torch.backends.cudnn.rnn.fp32_precision = mode
    else:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast every floating parameter and buffer to `dtype` in place (Megatron's Float16Module does
    the same).

    Nothing in the model stays fp32 but the buffers a module lists in `fp32_buffers` (statistics
    stepped outside autograd: the MoE routing bias): the fp32 copy of each weight lives in the optimizer engine
    (master weights), not here. LayerNorm weights in bf16 are fine because torch's layer_norm
    accumulates mean and variance in fp32 internally; softmax and loss upcast their input themselves
    (model.causal_softmax, model.cross_entropy), so they run in fp32 whatever the model dtype.
    Parameter identity (and tags such as p.tensor_parallel, and ties such as lm_head.weight is
    embed.wte.weight) is kept: .to() on a module swaps p.data, not the Parameter object.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"cast_model needs a floating dtype, got {dtype}")
    model.to(dtype=dtype)

    # the buffers a module names in fp32_buffers stay fp32 (moe.MoE's routing bias: its 1e-3 steps
    # round to nothing in bf16 once |b| passes 0.25)
    for module in model.modules():
        for name in getattr(module, "fp32_buffers", ()):
            setattr(module, name, getattr(module, name).float())
    return model


def fp32_master(weights: torch.Tensor) -> torch.Tensor:
    """The fp32 master copy of (a slice of) 16-bit weights; fp32 weights are their own
    master (no copy)."""
    return weights.float()


def unscale_(grad: torch.Tensor, scaler) -> None:
    """fp32 gradients of a scaled loss -> the true gradients, in place (in fp32: g/S in fp16
    would underflow)."""
    if scaler is not None and scaler.scale != 1.0:
        grad.mul_(1.0 / scaler.scale)


def write_back(master: torch.Tensor, weights: torch.Tensor) -> None:
    """The updated fp32 master -> the weights the model computes with, rounded to their dtype."""
    if master is not weights:
        weights.copy_(master)


class LossScaler:
    """Loss scaling for fp16 training: dynamic (fp16) or static (scale 1.0: bf16/fp32, nothing to
    do).

    Protocol per optimizer step (zero.ZeroEngine.step does the middle part):
    `scale_loss(loss).backward()` on every micro-batch; the engine multiplies its fp32 gradients by
    1/scale (in fp32: g/S in fp16 would underflow again) and takes the global gradient norm,
    all-reduced over dp, tp and pp, so every rank sees the same inf/nan; on inf/nan it skips the
    optimizer step; then it calls `update(found_inf)`.
    """

    def __init__(
        self,
        init_scale=2.0**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1000,
        dynamic=True,
        min_scale=1.0,
    ):
        if not (
            growth_factor > 1.0
            and 0.0 < backoff_factor < 1.0
            and growth_interval >= 1
            and init_scale > 0
        ):
            raise ValueError(
                "LossScaler needs growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1, "
                "init_scale > 0"
            )

        self.scale = float(init_scale) if dynamic else 1.0
        self.growth_factor, self.backoff_factor, self.growth_interval = (
            growth_factor,
            backoff_factor,
            growth_interval,
        )
        self.dynamic, self.min_scale = dynamic, min_scale
        self.good_steps = 0  # clean steps since the last change of scale
        self.skipped = 0  # optimizer steps skipped because of inf/nan

    @classmethod
    def for_dtype(cls, dtype: torch.dtype, **kw) -> "LossScaler":
        """fp16 -> dynamic scaling; bf16 and fp32 have fp32's exponent range -> static scale 1.0."""
        return cls(dynamic=dtype == torch.float16, **kw)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scale != 1.0 else loss

    def update(self, found_inf: bool) -> None:
        """After each step: back off on inf/nan (the step was skipped), grow after growth_interval
        clean steps."""
        if found_inf:
            self.skipped += 1
        if not self.dynamic:
            return
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped": self.skipped,
            "dynamic": self.dynamic,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps, self.skipped = (
            float(state["scale"]),
            state["good_steps"],
            state["skipped"],
        )
        self.dynamic = state["dynamic"]
