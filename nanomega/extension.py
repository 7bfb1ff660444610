"""The C++/CUDA extension: nanomega/csrc built on first use, cached per machine, loaded by name.

torch.utils.cpp_extension.load (ninja, pybind11) compiles csrc/ into one Python module under one
cache root ($NANOMEGA_BUILD_DIR, default ~/.cache/nanomega/build), in a folder keyed by what the
binary depends on: a binary built for one CPU (or GPU) is never loaded on another. CUDA sources join
the build when CUDA is available; if that build fails, the CPU-only build is loaded instead (the CPU
kernels and CPU Adam kept, CUDA tensors on the PyTorch path) and the failure is remembered in the
CUDA build's folder (a FAILED file: later loads, in any process, skip it until it is deleted). The
kernels of fused.py and cpu_adam.py live in this one module. If no build is possible, a one-line
notice, and their callers take the PyTorch path.

    key    = sha256(torch version, torch's folder, flags [, CPU model and features if -march=native]
                    [, CUDA version and GPU architectures], sources and headers)[:12]
    folder = build_dir() / nanomega_fused_{cpu|cuda}-{key}

Lesson: lessons/13-fused-kernels.md (the appendix: the build)
"""

import functools
import hashlib
import os
import platform
import shutil
import sys

import torch

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def build_dir() -> str:
    """The root of the one build cache shared by the library, tests, bench and lessons."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "nanomega", "build")
    return os.environ.get("NANOMEGA_BUILD_DIR") or default


def march() -> str:
    """The -march target: "native" (this CPU's every instruction), or $NANOMEGA_MARCH, e.g.
    x86-64-v3 to build what an AVX2-only CPU runs while sitting at an AVX-512 one."""
    return os.environ.get("NANOMEGA_MARCH", "native")


def cpu_flags() -> list[str]:
    """-O3 -march=... -ffast-math, and the at::vec ISA that torch dispatches to on this CPU."""
    # "AVX512", "AVX2", "DEFAULT" (ATEN_CPU_CAPABILITY picks)
    cap = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-ffast-math", "-fopenmp", f"-DCPU_CAPABILITY={cap}"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append(f"-march={march()}")
    if cap in ("AVX2", "AVX512"):  # selects Vectorized<float> = __m256 / __m512 in the ATen headers
        flags.append(f"-DCPU_CAPABILITY_{cap}")
    # -ffast-math assumes no inf/nan: the softmax never forms exp(-inf) (masked keys are skipped),
    # and it is a compile flag only -- not linked, so no crtfastmath.o flushing denormals
    # process-wide
    return flags


def cpu_info() -> dict:
    """The first CPU's /proc/cpuinfo fields ({} where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            first_cpu = f.read().split("\n\n")[0].splitlines()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in first_cpu if ":" in line)
    return {k.strip(): v.strip() for k, v in fields}


def cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (avx2, avx512f, ...)."""
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
    dispatch = torch.backends.cpu.get_cpu_capability()
    return f"{name}: {have}{', no ' + lack if lack else ''}; torch dispatches {dispatch}"


def cuda_target() -> str:
    """What a CUDA build is compiled for besides its flags: torch's CUDA version and the GPU
    architectures, $TORCH_CUDA_ARCH_LIST, or where it is unset (or "native") the visible GPUs'
    compute capabilities, as cpp_extension picks them."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if archs in ("", "native"):
        archs = " ".join(
            sorted(
                {
                    "%d.%d" % torch.cuda.get_device_capability(i)
                    for i in range(torch.cuda.device_count())
                }
            )
        )
    return f"cuda {torch.version.cuda} arch {archs}"


def build_key(sources: list[str], cflags: list[str], with_cuda: bool = False) -> str:
    """Hash of everything the binary depends on: the sources, torch, the flags, -- for
    -march=native -- the CPU and, with CUDA, cuda_target(). ninja alone rebuilds on a changed
    command line, and "-march=native" reads the same on every CPU (and no flag names the GPU): a
    home directory shared by an AVX-512 and an AVX2 machine, or by A100 and H100 nodes, would hand
    one's binary to the other (SIGILL, no kernel image for the device) or rebuild it back and
    forth. One directory per key: machines sharing a cache each find their own build."""
    # torch's version and where it lies: its headers' path is in ninja's command, so two
    # environments sharing the cache would otherwise rebuild each other's binary back and forth
    torch_at = f"{torch.__version__} {os.path.dirname(torch.__file__)}"
    h = hashlib.sha256(f"{torch_at} {' '.join(cflags)}".encode())
    if "-march=native" in cflags:
        h.update(cpu_features().encode())
    if with_cuda:
        h.update(cuda_target().encode())
    for path in sources:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def load_extension(verbose: bool = False):
    """Build (cold ~45 s) or load (cached ~0.05 s) the extension: with the CUDA kernels where CUDA
    and nvcc are, else (or if that build fails, or failed before) the CPU kernels alone; raises if
    the CPU build fails."""
    # imported here, not at the top: on a CUDA build of torch without a GPU, importing it logs a
    # warning line, which would break "bad input gets one clear line" for every command that
    # imports nanomega
    from torch.utils import cpp_extension

    with_cuda = torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None
    if torch.cuda.is_available() and not with_cuda:
        print(
            "nanomega.extension: CUDA but no CUDA toolkit (nvcc): CPU kernels only, CUDA tensors "
            "take the PyTorch path",
            file=sys.stderr,
        )
    if with_cuda:
        build = build_args(with_cuda=True)
        failed = os.path.join(build["build_directory"], "FAILED")
        if not os.path.exists(failed):
            try:
                return cpp_extension.load(**build, verbose=verbose)
            except Exception as e:  # nvcc's error: remembered, and the CPU build still loads
                with open(failed, "w") as f:
                    f.write(f"{e}\n")
        _notice_once(
            f"nanomega.extension: the CUDA build failed ({first_error(open(failed).read())}); CPU "
            f"kernels only, CUDA tensors take the PyTorch path. Delete {failed} to retry"
        )
    return cpp_extension.load(**build_args(with_cuda=False), verbose=verbose)


def build_args(with_cuda):
    """cpp_extension.load's arguments for the CPU or the CUDA build, its folder keyed."""
    name = "nanomega_fused_cuda" if with_cuda else "nanomega_fused_cpu"
    sources = ["fused_cpu.cpp", "cpu_adam.cpp"]
    sources += ["fused_cuda.cu", "fused_cuda_bind.cpp"] if with_cuda else []
    sources = [os.path.join(CSRC, s) for s in sources]
    defines = ["-DNANOMEGA_WITH_CUDA"] if with_cuda else []
    cflags = cpu_flags() + defines
    # no --use_fast_math: the kernels are bound by memory, so it buys nothing, and it turns exp into
    # __expf, whose error grows with |x| past the bounds tests/test_fused.py derives (issue 42)
    cuda_cflags = ["-O3"] + defines
    headers = sorted(os.path.join(CSRC, h) for h in os.listdir(CSRC) if h.endswith(".h"))
    key = build_key(sources + headers, cflags + cuda_cflags, with_cuda)
    directory = os.path.join(build_dir(), f"{name}-{key}")  # one build.ninja per extension and key
    sources = _staged(directory, sources + headers)[: len(sources)]
    include = os.path.join(directory, "src")

    # concurrent jobs (ranks of a host, jobs sharing a home) are already safe: cpp_extension.load
    # takes a FileBaton (a `lock` file in `directory`): one process builds, the others wait, then
    # all load. A build killed midway leaves that file behind and the next load waits on it
    # forever: delete `directory`/lock.
    return dict(
        name=name,
        sources=sources,
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_cflags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[include],
        build_directory=directory,
    )


def _staged(directory, paths):
    """Copies of the sources in the build directory (its key is their content), compiled from
    there: ninja rebuilds when a command line changes, and the checkout's path is in it, so a
    second clone of the same sources would rebuild. Written once, atomically (ranks start
    together); never rewritten (a newer mtime would rebuild too)."""
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


def first_error(message: str) -> str:
    """A build error's telling line: the compiler's `error:` line if any, else its last line."""
    lines = message.strip().splitlines() or ["unknown error"]
    return next((ln for ln in lines if "error:" in ln), lines[-1]).strip()[:200]


@functools.cache
def _notice_once(line):
    print(line, file=sys.stderr)


@functools.cache
def _ext():
    try:
        return load_extension()
    except Exception as e:  # no compiler, no ninja, a compile error: fall back, say so once
        reason = first_error(str(e) or type(e).__name__)
        print(
            f"nanomega.extension: cannot build the C++ kernels ({reason}); using the PyTorch path",
            file=sys.stderr,
        )
        return None


def available() -> bool:
    """True when the C++ kernels are built (building them on first call)."""
    return _ext() is not None


def extension():
    """The built extension module (building it on first call), or None after the one-line
    notice: for the modules whose kernels live in it (fused.py, cpu_adam.py)."""
    return _ext()
