"""Fused kernels: LayerNorm, scale + causal mask + softmax, bias + GeLU, RMSNorm, SwiGLU -- one pass
over memory each.

Idea: these ops do ~1-3 FLOPs per byte, far below a machine's balance (peak FLOP/s / bytes/s,
~10-100), so their time is bytes moved / bandwidth. Eager PyTorch runs one kernel per step and
writes every intermediate to memory; a fused kernel reads its inputs once and writes its outputs
once (Megatron-LM's fused bias-GeLU, scaled_upper_triang_masked_softmax, fused LayerNorm; for Llama
blocks (modern.py) Megatron-Core's fused SwiGLU and apex's / Transformer Engine's fused RMSNorm).
The causal softmax also skips the masked half: row i reads keys j <= i only.

Formula (elements moved, forward + backward, x4 bytes in fp32; n = elements of the activation):
    bias + GeLU       eager 8n  (add 2n, gelu 2n | gelu_backward 3n, bias-sum n)   fused 5n
    causal softmax    eager 13n (scale 2n, mask 2n, softmax 2n | 3n, 2n, 2n)       fused 3v + 2n
                      (v = n (s+1) / 2s keys visible: the kernel never reads the masked ones)
    LayerNorm         eager 5n  (PyTorch's native_layer_norm is one kernel already)  fused 5n
    RMSNorm           eager 31n (pow 2n, mean n, *rstd 2n, *w 2n | dy*w 2n, dy*y 3n, sum n,  fused 5n
                      *x 3n, sum n, *rstd 2n, mean' 2n, pow' 7n, add 3n; counted per aten kernel as lesson 13
                      does: mean' reads a stride-0 (rows, 1) view, so 30n really)
    SwiGLU            eager 18n (silu 2n, mul 3n | mul 3n, mul 3n, silu_backward 3n, cat 4n)  fused 8n
                      (n = elements of the output, gate_up holds 2n: fused reads 2n, writes n | reads 3n, writes 2n)

The C++ sources (nanomega/csrc) are built and cached by extension.py. If the build is impossible,
a one-line notice and the PyTorch functions of model.py and modern.py are used.
Lesson: lessons/13-fused-kernels.md
"""

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from nanomega import extension, model, modern

_ext = extension.extension  # the built C++ module, or None (built on first call: extension.py)


def _runs_on(t: torch.Tensor) -> bool:
    """Whether the built extension has kernels for t's device (CPU always; CUDA in a CUDA build)."""
    ext = _ext()
    return ext is not None and (
        t.device.type == "cpu" or (t.device.type == "cuda" and ext.with_cuda)
    )


class LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _ext().layer_norm_fwd(x, weight, bias, eps)  # mean, rstd: (rows,) in opmath
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        dx, dweight, dbias = _ext().layer_norm_bwd(dy, *ctx.saved_tensors)
        return dx, dweight, dbias, None


class CausalSoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores, scale):
        probs = _ext().causal_softmax_fwd(scores, scale)
        ctx.save_for_backward(probs)  # backward needs only the output, as Megatron's kernel
        ctx.scale = scale
        return probs

    @staticmethod
    @once_differentiable
    def backward(ctx, dprobs):
        (probs,) = ctx.saved_tensors
        return _ext().causal_softmax_bwd(dprobs, probs, ctx.scale), None


class BiasGeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)  # x + bias is recomputed in backward, never stored
        return _ext().bias_gelu_fwd(x, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return tuple(_ext().bias_gelu_bwd(dy, *ctx.saved_tensors))


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _ext().rms_norm_fwd(x, weight, eps)  # rstd: (rows,) in opmath
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        dx, dweight = _ext().rms_norm_bwd(dy, *ctx.saved_tensors)
        return dx, dweight, None


class SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        # silu(gate) recomputed in backward: 2n kept (eager keeps silu(gate) too: 3n)
        ctx.save_for_backward(gate_up)
        return _ext().swiglu_fwd(gate_up)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        return _ext().swiglu_bwd(dy, *ctx.saved_tensors)


def layer_norm(x, weight, bias, eps=1e-5):
    """F.layer_norm(x, (h,), weight, bias, eps) over the last dim, one pass per row."""
    if not _runs_on(x):
        return nn.functional.layer_norm(x, weight.shape, weight, bias, eps)
    return LayerNormFn.apply(x, weight, bias, eps)


def causal_softmax(scores, scale):
    """model.causal_softmax in one pass: (..., s_q, s_k) -> probs, opmath inside, scores' dtype
    out."""
    if not _runs_on(scores):
        return model.causal_softmax(scores, scale)
    return CausalSoftmaxFn.apply(scores, float(scale))


def bias_gelu(x, bias):
    """model.bias_gelu = gelu_tanh(x + bias) in one pass; bias (h,) over the last dim of x."""
    if not _runs_on(x):
        return model.bias_gelu(x, bias)
    return BiasGeluFn.apply(x, bias)


def rms_norm(x, weight, eps=1e-5):
    """modern.rms_norm in one pass per row: w * (x / sqrt(mean(x^2) + eps)) with opmath inside, x
    rounded where eager rounds it. A weight of another dtype than x (eager promotes: fp32 weight,
    bf16 x -> fp32 out) takes modern.rms_norm."""
    if not _runs_on(x) or weight.dtype != x.dtype:
        return modern.rms_norm(x, weight, eps)
    return RMSNormFn.apply(x, weight, float(eps))


def swiglu(gate_up):
    """modern.swiglu = silu(gate) * up of a (..., 2f) tensor laid out [gate | up], in one pass."""
    if not _runs_on(gate_up):
        return modern.swiglu(gate_up)
    return SwiGLUFn.apply(gate_up)


def apply_fused(gpt: nn.Module) -> bool:
    """Swap in the fused kernels, through the model's op tables (seams.Ops): norm (LayerNorm or
    RMSNorm), activation (bias-GeLU or SwiGLU) and the eager core's softmax. Entries are looked up
    at call time, so recompute's checkpoints use them too; parameters are untouched (names,
    tensor-parallel tags and gradient hooks stay). Returns False, leaving the PyTorch path, when the
    kernels cannot be built."""
    if not extension.available():
        return False
    llama = gpt.cfg.arch == "llama"
    gpt.replace_op("norm", rms_norm if llama else layer_norm)
    gpt.replace_op("activation", swiglu if llama else bias_gelu)
    gpt.replace_op("softmax", causal_softmax)
    return True


def apply_fused_softmax(gpt: nn.Module) -> None:
    """--attention fused: only the eager attention core's scale-mask-softmax becomes the fused
    kernel."""
    gpt.replace_op("softmax", causal_softmax)
