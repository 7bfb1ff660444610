"""Multi-node faults on one machine (scripts/local_cluster.sh, 2 hosts x 2 ranks, tp 2 in a host, dp
2 across): a lost host restarted, a host lost for good (elastic resize to 1 host at the same global
batch), a link down longer than the collective timeout. Prints the numbers in bench/RESULTS.md and
checks each result.

    python bench/multinode.py            # needs root and iproute2; ~6 min on 2 shared cores

Times come from the arrival of each output line (the cluster's own lines and the ranks' lines):
detection = fault -> first survivor line that reports it; resume = fault -> "resumed from";
steps recomputed = step at the fault - step of the checkpoint resumed from.
"""

import argparse
import gzip
import json
import os
import re
import shutil
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
    "--dropout",
    "0",
    "--warmup",
    "1",
    "--lr",
    "3e-3",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--peak-flops",
    "1e11",
    "--save-every",
    "2",
    "--tp",
    "2",
    "--batch-size",
    "2",
    "--global-batch",
    "8",
    "--resume",
]
DETECT = re.compile(r"error: rank|Connection reset|Connection closed|Timed out|failed \(exitcode")


def cluster(nodes, out, corpus, steps, options=(), extra=()):
    """Run local_cluster.sh; returns (exit code, [(seconds since start, line)])."""
    cmd = [
        "bash",
        str(ROOT / "scripts" / "local_cluster.sh"),
        str(nodes),
        "2",
        "--timeout",
        "500",
        *options,
        "--",
        *MODEL,
        "--max-steps",
        str(steps),
        "--corpus",
        str(corpus),
        "--data-cache",
        str(Path(out).parent / "cache"),
        "--out-dir",
        str(out),
        *extra,
    ]
    t0 = time.monotonic()
    job = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        bufsize=1,
    )
    lines = [(time.monotonic() - t0, line.rstrip()) for line in job.stdout]
    job.wait(timeout=60)
    if job.returncode == 77:
        sys.exit(lines[-1][1])
    return job.returncode, lines


def losses(out):
    """{step: loss}, the last record of each step (a resumed run logs the recomputed steps
    again)."""
    return {
        r["step"]: r["loss"]
        for r in map(json.loads, open(Path(out) / "metrics.jsonl"))
        if "loss" in r
    }


def weights(out):
    return reshard.full_weights(checkpoint.latest(out))


def bitwise(a, b):
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def timeline(lines, fault_pattern):
    """(fault step, detection s, resume s, first step after resume s, resumed-from step, total
    s)."""
    t_fault, step_fault = next(
        (t, int(re.search(r"at step (\d+)", l)[1])) for t, l in lines if re.search(fault_pattern, l)
    )
    t_detect = next(t for t, l in lines if t > t_fault and DETECT.search(l))
    t_resume, step_resume = next(
        (t, int(re.search(r"at step (\d+)", l)[1]))
        for t, l in lines
        if t > t_fault and "resumed from" in l
    )
    t_step = next(t for t, l in lines if t > t_resume and re.search(r"\] step +\d+ loss", l))
    return (
        step_fault,
        t_detect - t_fault,
        t_resume - t_fault,
        t_step - t_fault,
        step_resume,
        lines[-1][0],
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--down-seconds", type=int, default=25)
    p.add_argument("--collective-timeout", type=int, default=10)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="multinode-"))
    corpus = root / "small.txt"
    corpus.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(200_000))
    n, at = args.steps, args.fault_step
    rows = []

    rc, lines = cluster(2, root / "plain", corpus, n)
    assert rc == 0, "\n".join(l for _, l in lines[-40:])
    ref_loss, ref_w = losses(root / "plain"), weights(root / "plain")
    print(
        f"uninterrupted 2 hosts x 2: {lines[-1][0]:.1f} s, losses {[round(ref_loss[s], 4) for s in sorted(ref_loss)]}"
    )

    scenarios = [
        (
            "lost host, agent restarted",
            "kill",
            ["--kill-node", f"1@{at}", "--max-restarts", "2"],
            [],
            r"host 1 lost",
        ),
        (
            f"link down {args.down_seconds} s (timeout {args.collective_timeout} s)",
            "down",
            ["--down-link", f"1@{at}:{args.down_seconds}", "--max-restarts", "2"],
            ["--collective-timeout", str(args.collective_timeout)],
            r"link down",
        ),
        (
            "host lost for good, elastic 1:2",
            "elastic",
            ["--kill-node", f"1@{at}", "--elastic", "1", "--max-restarts", "2"],
            [],
            r"host 1 lost",
        ),
    ]
    for title, name, options, extra, pattern in scenarios:
        out = root / name
        rc, lines = cluster(2, out, corpus, n, options, extra)
        assert rc == 0, "\n".join(l for _, l in lines[-60:])
        fault, detect, resume, first, resumed, total = timeline(lines, pattern)
        got = losses(out)
        named = [l for _, l in lines if "error: rank" in l]
        if name == "elastic":  # the new layout from the same checkpoint, uninterrupted: 1 host x 2
            again = root / "elastic-ref"
            (again / "ckpt").mkdir(parents=True)
            folder = f"step_{resumed:06d}"
            shutil.copytree(out / "ckpt" / folder, again / "ckpt" / folder)
            (again / "ckpt" / "latest").write_text(folder)
            rc2, _ = cluster(1, again, corpus, n)
            assert rc2 == 0
            want, same_w = losses(again), bitwise(weights(out), weights(again))
            close = all(abs(got[s] - want[s]) <= 1e-6 * abs(want[s]) for s in want)
            check = (
                f"after resize vs 1-host run from step {resumed}: losses rel<=1e-6 {close}, final weights "
                f"bitwise {same_w}; vs 2-host run: max rel loss diff "
                f"{max(abs(got[s] - ref_loss[s]) / ref_loss[s] for s in ref_loss):.1e}"
            )
            world = [l for _, l in lines if "Grid(rank" in l][-1].split("Grid(")[1].split(":")[0]
            check += f"; last grid: {world}"
        else:
            same = [got[s] for s in sorted(got)] == [ref_loss[s] for s in sorted(ref_loss)]
            check = f"losses bitwise {same}, final weights bitwise {bitwise(weights(out), ref_w)}"
        rows.append((title, fault, detect, resume, first, fault - resumed, total, check, named[:1]))
        print(
            f"{title}: fault at step {fault}, detected +{detect:.1f} s, resumed +{resume:.1f} s "
            f"(from step {resumed}), first step +{first:.1f} s, steps recomputed {fault - resumed}, "
            f"job {total:.1f} s; {check}",
            flush=True,
        )
        for line in named[:1]:
            print(f"    {line}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
