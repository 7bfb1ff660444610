"""Slurm-style preemption, counted: SIGTERM to every worker and, 20 ms later, to the torchrun agent
(which forwards its own), N times; how many trials wrote their checkpoint and exited 0 (issue 28,
item 5).

    python bench/bench_preempt.py --trials 10
"""

import argparse
import gzip
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import kill_resume  # noqa: E402
from nanomega import checkpoint  # noqa: E402


def trial(corpus, out, delay):
    job = kill_resume.torchrun(corpus, out, 2, 400, ["--save-every", "0"], restarts=0)
    try:
        while kill_resume.logged_step(out) < 3 and job.poll() is None:
            time.sleep(0.05)
        for pid in kill_resume.worker_pids(job.pid).values():
            os.kill(pid, signal.SIGTERM)
        time.sleep(delay)
        job.send_signal(signal.SIGTERM)
        log, _ = job.communicate(timeout=60)
        return checkpoint.latest(out) is not None and ": preempted (signal)" in log
    finally:
        job.kill()
        job.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument(
        "--delay",
        type=float,
        default=0.02,
        help="seconds between the workers' signal and the agent's",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        corpus = Path(root) / "small.txt"
        corpus.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(300_000))
        ok = sum(trial(corpus, Path(root) / f"t{i}", args.delay) for i in range(args.trials))
    print(
        f"checkpoint written and exit 0 in {ok} of {args.trials} trials (every worker, then the agent "
        f"{args.delay * 1e3:.0f} ms later)"
    )


if __name__ == "__main__":
    main()
