import gzip
import importlib.metadata
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def one_thread():
    """One OpenMP thread for a module's in-process training: with other processes on the 2 cores, 2 threads
    spin-wait and run ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def corpus(request, tmp_path_factory):
    """A small.txt of the embedded corpus's first CORPUS_CHARS characters (a module may set CORPUS_CHARS;
    300,000 by default: enough windows for a few steps, tokenized in a moment), one per test module."""
    chars = getattr(request.module, "CORPUS_CHARS", 300_000)
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(chars))
    return path


@pytest.fixture(scope="module")
def grid():
    """A world of one in this process (gloo on a HashStore); torn down if this module started it."""
    from nanomega import dist
    started = not torch.distributed.is_initialized()
    dist.init("cpu")
    yield dist.Grid(1, 1, 1)
    if started:
        torch.distributed.destroy_process_group()


def pytest_configure(config):
    """The CPU suite runs on the CPU on any machine: on a GPU host `--device auto` would pick CUDA, and two ranks
    on one GPU fail ("LOCAL_RANK 1 but this node sees 1 CUDA device"). train.py's default device comes from
    $NANOMEGA_DEVICE, inherited by every subprocess and torchrun job of the tests; the GPU tier (-m gpu) sets
    its device itself (tests/test_gpu.py)."""
    if "gpu" not in (config.option.markexpr or ""):
        os.environ.setdefault("NANOMEGA_DEVICE", "cpu")


VERSIONS = ("torch", "numpy", "tiktoken", "pytest", "transformers")  # what a fresh install resolved


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def pytest_sessionstart(session):
    """The CPU the suite runs on, printed first even under -q: tolerances are derived (tests/tolerance.py),
    but a failure report should still say which vector ISA and kernels produced it (ATEN_CPU_CAPABILITY
    and NANOMEGA_MARCH make this CPU take another's code paths)."""
    from nanomega import fused
    forced = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "NANOMEGA_MARCH", "MKL_ENABLE_INSTRUCTIONS",
                                         "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS") if k in os.environ}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"cpu: {fused.cpu_summary()}; {torch.get_num_threads()} threads; "
                            f"emulating: {forced or 'nothing (native)'}")
        reporter.write_line("versions: " + ", ".join(f"{name} {_version(name)}" for name in VERSIONS))
