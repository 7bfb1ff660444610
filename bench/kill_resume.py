"""Kill a random rank (SIGKILL) at a random step under `torchrun --max-restarts`; the job must
restart by itself, resume from the last complete checkpoint, and end with the weights of an
uninterrupted run.

    python bench/kill_resume.py --runs 20        # the numbers in bench/RESULTS.md
tests/test_faults.py runs one trial of the same harness.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from nanomega import checkpoint, reshard  # noqa: E402

MODEL = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--dropout",
    "0.1",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--peak-flops",
    "1e11",
    "--warmup",
    "2",
]


def torchrun(corpus, out, nproc, steps, extra=(), restarts=3, log_dir=None):
    """A torchrun job of train.py (output on the pipe). log_dir: torchrun's --log-dir, where each
    failed worker's error file (the JSON that lifecycle.entrypoint records) can be found; the
    console output stays."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={restarts}",
        *([f"--log-dir={log_dir}"] if log_dir else []),
        "nanomega/train.py",
        *MODEL,
        "--corpus",
        str(corpus),
        "--data-cache",
        str(Path(out).parent / "cache"),
        "--out-dir",
        str(out),
        "--max-steps",
        str(steps),
        "--save-every",
        "2",
        "--resume",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def logged_step(out):
    try:
        lines = open(Path(out) / "metrics.jsonl").read().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def worker_pids(parent):
    """{rank: pid} of torchrun's worker processes, read from their environment."""
    pids = {}
    for pid in subprocess.run(
        ["pgrep", "-P", str(parent)], capture_output=True, text=True
    ).stdout.split():
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except FileNotFoundError:
            continue
        rank = [e for e in env if e.startswith(b"RANK=")]
        if rank:
            pids[int(rank[0][5:])] = int(pid)
    return pids


def trial(corpus, root, nproc, steps, kill_step, kill_rank, extra=()):
    """One killed run; returns (weights equal to the reference's, restarts seen, seconds)."""
    t0 = time.time()
    # a fresh run
    out = Path(tempfile.mkdtemp(prefix=f"killed-{kill_rank}-{kill_step}-", dir=root)) / "out"
    job = torchrun(corpus, out, nproc, steps, extra)
    while logged_step(out) < kill_step and job.poll() is None:
        time.sleep(0.05)
    killed = worker_pids(job.pid).get(kill_rank)
    if killed:
        os.kill(killed, signal.SIGKILL)
    log, _ = job.communicate(timeout=600)
    if job.returncode != 0:
        raise RuntimeError(f"killed run failed (rc {job.returncode}):\n{log[-3000:]}")
    ref = reference(corpus, root, nproc, steps, extra)
    a, b = (
        reshard.full_weights(checkpoint.latest(out)),
        reshard.full_weights(checkpoint.latest(ref)),
    )
    same = a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    resumed = log.count("resumed from")
    return same, bool(killed), resumed, time.time() - t0


_REFS = {}


def reference(corpus, root, nproc, steps, extra):
    key = (nproc, steps, tuple(extra))
    if key not in _REFS:
        out = Path(root) / f"reference-{len(_REFS)}"
        job = torchrun(corpus, out, nproc, steps, extra, restarts=0)
        log, _ = job.communicate(timeout=600)
        if job.returncode != 0:
            raise RuntimeError(f"reference run failed:\n{log[-3000:]}")
        _REFS[key] = out
    return _REFS[key]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra", default="--zero 1", help="layout flags, e.g. '--tp 2' or '--pp 2'")
    args = p.parse_args()
    import gzip

    root = Path(tempfile.mkdtemp(prefix="kill_resume-"))
    corpus = root / "small.txt"
    corpus.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(300_000))
    rng = random.Random(args.seed)
    ok = 0
    for i in range(args.runs):
        step, rank = rng.randint(1, args.steps - 2), rng.randrange(args.nproc)
        same, killed, resumed, secs = trial(
            corpus, root, args.nproc, args.steps, step, rank, args.extra.split()
        )
        ok += same and killed
        print(
            f"run {i + 1:2d}: kill rank {rank} at step >= {step}: killed {killed}, resumed {resumed}x, "
            f"final weights equal: {same} ({secs:.0f} s)",
            flush=True,
        )
    print(
        f"{ok} of {args.runs} runs killed a rank and ended bitwise equal to the uninterrupted run"
    )


if __name__ == "__main__":
    main()
