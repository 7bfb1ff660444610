"""Fused kernels: LayerNorm, scale + causal mask + softmax, bias + GeLU, RMSNorm, SwiGLU -- one pass over memory each.

Idea: these ops do ~1-3 FLOPs per byte, far below a machine's balance (peak FLOP/s / bytes/s, ~10-100),
so their time is bytes moved / bandwidth. Eager PyTorch runs one kernel per step and writes every
intermediate to memory; a fused kernel reads its inputs once and writes its outputs once (Megatron-LM's
fused bias-GeLU, scaled_upper_triang_masked_softmax, fused LayerNorm; for Llama blocks (modern.py)
Megatron-Core's fused SwiGLU and apex's / Transformer Engine's fused RMSNorm). The causal softmax also skips
the masked half: row i reads keys j <= i only.

Formula (elements moved, forward + backward, x4 bytes in fp32; n = elements of the activation):
    bias + GeLU       eager 8n  (add 2n, gelu 2n | gelu_backward 3n, bias-sum n)   fused 5n
    causal softmax    eager 13n (scale 2n, mask 2n, softmax 2n | 3n, 2n, 2n)       fused 3v + 2n
                      (v = n (s+1) / 2s keys visible: the kernel never reads the masked ones)
    LayerNorm         eager 5n  (PyTorch's native_layer_norm is one kernel already)  fused 5n
    RMSNorm           eager 31n (pow 2n, mean n, *rstd 2n, *w 2n | dy*w 2n, dy*y 3n, sum n,  fused 5n
                      *x 3n, sum n, *rstd 2n, mean' 2n, pow' 7n, add 3n; counted per aten kernel as lesson 08
                      does: mean' reads a stride-0 (rows, 1) view, so 30n really)
    SwiGLU            eager 18n (silu 2n, mul 3n | mul 3n, mul 3n, silu_backward 3n, cat 4n)  fused 8n
                      (n = elements of the output, gate_up holds 2n: fused reads 2n, writes n | reads 3n, writes 2n)

The C++ sources (nanomega/csrc) are built on first use by torch.utils.cpp_extension.load (ninja,
pybind11) under ONE cache root ($NANOMEGA_BUILD_DIR, default ~/.cache/nanomega/build), in a folder keyed
by the sources, the flags and the CPU (build_key): a binary built for one CPU is never loaded on another.
CUDA sources join the build when CUDA is available (the key then adds the CUDA version and GPU architectures).
csrc/cpu_adam.cpp (cpu_adam.py's Adam/AdamW step) is compiled into the same module: one build, one cache key.
If the build is impossible, a one-line notice and the PyTorch functions of model.py and modern.py are used.
Lesson: lessons/08-fused-kernels.md
"""
import functools
import hashlib
import os
import platform
import shutil
import sys

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from nanomega import model, modern

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def build_dir() -> str:
    """The root of the one build cache shared by the library, tests, bench and lessons."""
    return os.environ.get("NANOMEGA_BUILD_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanomega", "build")


def march() -> str:
    """The -march target: "native" (this CPU's every instruction), or $NANOMEGA_MARCH, e.g.
    x86-64-v3 to build what an AVX2-only CPU runs while sitting at an AVX-512 one."""
    return os.environ.get("NANOMEGA_MARCH", "native")


def cpu_flags() -> list[str]:
    """-O3 -march=... -ffast-math, and the at::vec ISA that torch itself dispatches to on this
    CPU."""
    cap = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT" (ATEN_CPU_CAPABILITY picks)
    flags = ["-O3", "-ffast-math", "-fopenmp", f"-DCPU_CAPABILITY={cap}"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append(f"-march={march()}")
    if cap in ("AVX2", "AVX512"):  # selects Vectorized<float> = __m256 / __m512 in the ATen headers
        flags.append(f"-DCPU_CAPABILITY_{cap}")
    # -ffast-math assumes no inf/nan: the softmax never forms exp(-inf) (masked keys are skipped), and
    # it is a compile flag only -- not linked, so no crtfastmath.o flushing denormals process-wide
    return flags


def cpu_info() -> dict:
    """The first CPU's /proc/cpuinfo fields ({} where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            first_cpu = f.read().split("\n\n")[0].splitlines()
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first_cpu if ":" in line)}


def cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (avx2, avx512f, amx_tile,
    ...)."""
    info = cpu_info()
    if not info:  # not Linux: the platform's own description
        return f"{platform.machine()} {platform.processor()}"
    return f"{info.get('model name', '')} {info.get('flags', '')}"


def cpu_summary() -> str:
    """One line naming the CPU and the features that decide these kernels' and bf16's speed, e.g.
    "AMD EPYC: avx2 fma, no avx512f avx512_bf16 amx_bf16; torch dispatches AVX2"."""
    info = cpu_info()
    flags = set(info.get("flags", "").split())
    wanted = ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"]
    have = " ".join(f for f in wanted if f in flags) or "none of these"
    lack = " ".join(f for f in wanted if f not in flags)
    name = info.get("model name") or platform.processor() or platform.machine()
    return f"{name}: {have}{', no ' + lack if lack else ''}; torch dispatches {torch.backends.cpu.get_cpu_capability()}"


def cuda_target() -> str:
    """What a CUDA build is compiled for besides its flags: torch's CUDA version and the GPU
    architectures, $TORCH_CUDA_ARCH_LIST, or where it is unset (or "native") the visible GPUs'
    compute capabilities, as cpp_extension picks them."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if archs in ("", "native"):
        archs = " ".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i)
                                 for i in range(torch.cuda.device_count())}))
    return f"cuda {torch.version.cuda} arch {archs}"


def build_key(sources: list[str], cflags: list[str], with_cuda: bool = False) -> str:
    """Hash of everything the binary depends on: the sources, torch, the flags, -- for -march=native
    -- the CPU and, with CUDA, cuda_target(). ninja alone rebuilds on a changed command line, and
    "-march=native" reads the same on every CPU (and no flag names the GPU): a home directory shared
    by an AVX-512 and an AVX2 machine, or by A100 and H100 nodes, would hand one's binary to the
    other (SIGILL, no kernel image for the device) or rebuild it back and forth. One directory per
    key: machines sharing a cache each find their own build."""
    # torch's version and where it lies: its headers' path is in ninja's command, so two environments sharing
    # the cache would otherwise rebuild each other's binary back and forth
    h = hashlib.sha256(f"{torch.__version__} {os.path.dirname(torch.__file__)} {' '.join(cflags)}".encode())
    if "-march=native" in cflags:
        h.update(cpu_features().encode())
    if with_cuda:
        h.update(cuda_target().encode())
    for path in sources:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def load_extension(verbose: bool = False):
    """Build (cold ~45 s) or load (cached ~0.05 s) the extension; raises if the build fails."""
    # imported here, not at the top: on a CUDA build of torch without a GPU, importing it logs a warning
    # line, which would break "bad input gets one clear line" for every command that imports nanomega
    from torch.utils import cpp_extension
    with_cuda = torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None
    if torch.cuda.is_available() and not with_cuda:
        print("nanomega.fused: CUDA but no CUDA toolkit (nvcc): CPU kernels only, CUDA tensors take the "
              "PyTorch path", file=sys.stderr)
    name = "nanomega_fused_cuda" if with_cuda else "nanomega_fused_cpu"
    sources = ["fused_cpu.cpp", "cpu_adam.cpp"] + (["fused_cuda.cu", "fused_cuda_bind.cpp"] if with_cuda else [])
    sources = [os.path.join(CSRC, s) for s in sources]
    defines = ["-DNANOMEGA_WITH_CUDA"] if with_cuda else []
    cflags = cpu_flags() + defines
    cuda_cflags = ["-O3", "--use_fast_math"] + defines
    headers = sorted(os.path.join(CSRC, h) for h in os.listdir(CSRC) if h.endswith(".h"))
    key = build_key(sources + headers, cflags + cuda_cflags, with_cuda)
    directory = os.path.join(build_dir(), f"{name}-{key}")  # one build.ninja per extension and key
    sources, include = _staged(directory, sources + headers)[:len(sources)], os.path.join(directory, "src")
    # concurrent jobs (ranks of a host, jobs sharing a home) are already safe: cpp_extension.load takes a
    # FileBaton (a `lock` file in `directory`): one process builds, the others wait, then all load. A build
    # killed midway leaves that file behind and the next load waits on it forever: delete `directory`/lock.
    return cpp_extension.load(
        name, sources, extra_cflags=cflags, extra_cuda_cflags=cuda_cflags, extra_ldflags=["-fopenmp"],
        extra_include_paths=[include], build_directory=directory, verbose=verbose)


def _staged(directory, paths):
    """Copies of the sources in the build directory (its key is their content), compiled from there:
    ninja rebuilds when a command line changes, and the checkout's path is in it, so a second clone
    of the same sources would rebuild. Written once, atomically (ranks start together); never
    rewritten (a newer mtime would rebuild too)."""
    src = os.path.join(directory, "src")
    os.makedirs(src, exist_ok=True)
    staged = []
    for path in paths:
        staged.append(os.path.join(src, os.path.basename(path)))
        if not os.path.exists(staged[-1]):
            tmp = f"{staged[-1]}.{os.getpid()}.tmp"
            shutil.copyfile(path, tmp)
            os.replace(tmp, staged[-1])
    return staged


@functools.cache
def _ext():
    try:
        return load_extension()
    except Exception as e:  # no compiler, no ninja, a compile error: fall back, say so once
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = next((ln for ln in lines if "error:" in ln), lines[-1]).strip()[:200]  # the compiler's, if any
        print(f"nanomega.fused: cannot build the C++ kernels ({reason}); using the PyTorch path", file=sys.stderr)
        return None


def available() -> bool:
    """True when the fused kernels are built (building them on first call)."""
    return _ext() is not None


def extension():
    """The built extension module (building it on first call), or None after the one-line notice:
    for the modules whose kernels live in it (cpu_adam.py)."""
    return _ext()


def _runs_on(t: torch.Tensor) -> bool:
    """Whether the built extension has kernels for t's device (CPU always; CUDA in a CUDA build)."""
    ext = _ext()
    return ext is not None and (t.device.type == "cpu" or (t.device.type == "cuda" and ext.with_cuda))


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
        ctx.save_for_backward(gate_up)  # silu(gate) recomputed in backward: 2n kept (eager keeps silu(gate) too: 3n)
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
    if not available():
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
