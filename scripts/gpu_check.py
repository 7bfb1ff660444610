"""The GPU check: the day a GPU is lent, one command, one deadline, every result in $OUT.

    OUT=/folder/that/comes/back bash scripts/gpu_check.sh     # or: python3 scripts/gpu_check.py

The phases run in order, each a subprocess under its own cap and the time left (whichever is
shorter); a phase that needs CUDA is skipped, with the reason, where there is none:

    machine      the GPU(s), driver, torch, CUDA, the CPU
    extension    the C++/CUDA extension built, one forward and backward of every CUDA op (smoke())
    tier         python -m pytest -m "gpu and not trains": the GPU tier's in-process tests
    bench        bench/bench_gpu.py: GPT-2 124M bf16, nanomega and a plain PyTorch GPT of the same
                 shape in one process: tokens/s, MFU (llm.c's formula: formulas.llmc_flops_per_token),
                 peak memory; each row printed as it is measured
    trains       python -m pytest -m "gpu and trains": the tier's training subprocesses
    llama, moe   short train.py runs of a Llama model and of a mixture of experts, bf16

Files: OUT/gpu_check.md, the summary, written before the first phase and rewritten after every
phase (a phase killed by its cap or by the deadline reads "timed out", the ones after it "skipped");
OUT/gpu_check/NN-phase.log, each phase's whole output. Nothing else in OUT is touched. OUT: $OUT,
else the first argument, else ./gpu_check_out.
Nothing is downloaded: the checkout is imported from PYTHONPATH (`pip install -e .` needs build
isolation's downloads; gpu_check.sh sets PYTHONPATH instead).
Environment: GPU_CHECK_DEADLINE (seconds for everything, default 480: 8 minutes);
GPU_CHECK_FORCE=1 runs the CUDA phases without CUDA (the CPU dry run of caps and deadline:
tests/test_gpu_check.py).
"""

import dataclasses
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable  # gpu_check.sh starts us with the interpreter that has torch
TAIL = 25  # lines of each phase's log quoted in the summary
# nanomega and the plain GPT, each eager and compiled: the goal's rows (bench/RESULTS.md)
BENCH = "--steps 20 --batch-size 16 --attentions sdpa --compiles 0,1"


@dataclasses.dataclass
class Phase:
    name: str
    cap: float  # seconds at most, whatever time is left
    cuda: bool  # skipped without CUDA
    cmd: list
    status: str = "pending"
    seconds: float = 0.0
    tail: str = ""


def pytest_tier(marker):
    return [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, "tests/test_gpu.py"]


def train_run(out, name, *extra):
    """A short bf16 run of train.py on the corpus in the checkout (data/shakespeare.txt.gz)."""
    shape = "--n-layer 4 --n-head 8 --n-embd 512 --block-size 512 --batch-size 8 --max-steps 40"
    logs = "--log-every 10 --eval-every 0 --dtype bf16 --dropout 0"
    where = ["--out-dir", os.path.join(out, "gpu_check", name)]
    return [PY, "nanomega/train.py", *shape.split(), *logs.split(), *where, *extra]


def phases(out):
    machine = (
        "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || "
        "echo 'nvidia-smi: not found'; "
        f"{PY} -c \"import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, "
        "'gpus', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in "
        'range(torch.cuda.device_count())])"; '
        f"{PY} -c 'from nanomega import extension; print(extension.cpu_summary())'"
    )
    return [
        Phase("machine", 60, False, ["bash", "-c", machine]),
        Phase("extension", 180, True, [PY, os.path.abspath(__file__), "--smoke"]),
        Phase("tier", 120, True, pytest_tier("gpu and not trains")),
        Phase("bench", 200, True, [PY, "bench/bench_gpu.py", *BENCH.split()]),
        Phase("trains", 180, True, pytest_tier("gpu and trains")),
        Phase("llama", 60, True, train_run(out, "llama", "--arch", "llama")),
        Phase("moe", 60, True, train_run(out, "moe", "--arch", "llama", "--n-experts", "8")),
    ]


def cuda_available():
    probe = [PY, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"]
    return subprocess.run(probe, cwd=ROOT, capture_output=True).returncode == 0


def run(phase, log_path, seconds):
    """Run one phase with its output in log_path, killed (its whole process group: pytest's and
    train.py's children too) after `seconds`. Returns its status."""
    with open(log_path, "w") as log:
        child = subprocess.Popen(
            phase.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = child.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return f"timed out after {seconds:.0f} s"
    return "ok" if rc == 0 else f"failed (exit {rc})"


def write_summary(path, items, deadline, started):
    """OUT/gpu_check.md, written atomically: the table, then each phase's last lines."""
    lines = [
        f"# GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}",
        "",
        f"Deadline {deadline:.0f} s; {time.time() - started:.0f} s used so far.",
        "",
        "| phase | status | seconds | log |",
        "|---|---|---|---|",
    ]
    for i, p in enumerate(items):
        log = f"gpu_check/{i:02d}-{p.name}.log" if p.tail or p.seconds else "-"
        lines.append(f"| {p.name} | {p.status} | {p.seconds:.0f} | {log} |")
    for p in items:
        if p.tail:
            lines += ["", f"## {p.name}: {p.status}", "```", p.tail.rstrip(), "```"]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


def main(argv):
    out = os.environ.get("OUT") or (argv[0] if argv else os.path.join(ROOT, "gpu_check_out"))
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE", 480))
    force = os.environ.get("GPU_CHECK_FORCE") == "1"
    started = time.time()
    os.makedirs(os.path.join(out, "gpu_check"), exist_ok=True)
    summary = os.path.join(out, "gpu_check.md")
    items = phases(out)
    write_summary(summary, items, deadline, started)  # first: whatever happens next, it is there

    # each phase: skipped without CUDA or time, else run under min(cap, time left)
    cuda = cuda_available()
    for i, p in enumerate(items):
        left = deadline - (time.time() - started)
        if p.cuda and not (cuda or force):
            p.status = "skipped: no CUDA (torch.cuda.is_available() is False)"
        elif left < 1:
            p.status = "skipped: the deadline is spent"
        else:
            log_path = os.path.join(out, "gpu_check", f"{i:02d}-{p.name}.log")
            t0 = time.time()
            p.status = run(p, log_path, min(p.cap, left))
            p.seconds = time.time() - t0
            with open(log_path, errors="replace") as f:
                p.tail = "".join(f.readlines()[-TAIL:])
        write_summary(summary, items, deadline, started)
        print(f"gpu_check: {p.name}: {p.status}", flush=True)

    print(open(summary).read())
    return 0 if all(p.status == "ok" or p.status.startswith("skipped") for p in items) else 1


def smoke():
    """The extension phase: build (or load) the extension, then one forward and backward of every
    CUDA op in bf16 on GPT-2-sized rows, and LayerNorm at the widest preset's width (12288)."""
    import torch

    sys.path.insert(0, ROOT)
    from nanomega import cpu_adam, extension, fused

    if not torch.cuda.is_available():
        sys.exit("no CUDA: torch.cuda.is_available() is False")
    t0 = time.time()
    ext = extension.load_extension()
    print(f"extension {ext.__name__} in {time.time() - t0:.1f} s, with_cuda={ext.with_cuda}")
    print(f"CPU Adam: {cpu_adam.isa()}")
    rand = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ops = {
        "layer_norm": lambda: fused.layer_norm(rand(8, 1024, 768), rand(768), rand(768)),
        "layer_norm 12288": lambda: fused.layer_norm(rand(4, 12288), rand(12288), rand(12288)),
        "causal_softmax": lambda: fused.causal_softmax(rand(2, 12, 1024, 1024), 0.125),
        "bias_gelu": lambda: fused.bias_gelu(rand(8, 1024, 3072), rand(3072)),
        "rms_norm": lambda: fused.rms_norm(rand(8, 1024, 768), rand(768)),
        "swiglu": lambda: fused.swiglu(rand(8, 1024, 2 * 2048)),
    }
    failed = 0
    for name, op in ops.items():
        try:
            op().float().sum().backward()
            torch.cuda.synchronize()
            print(f"{name}: ok")
        except Exception as e:  # every op is tried; the phase fails if any did
            failed += 1
            print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    sys.exit(1 if failed or not ext.with_cuda else 0)


if __name__ == "__main__":
    if sys.argv[1:] == ["--smoke"]:
        smoke()
    sys.exit(main(sys.argv[1:]))
