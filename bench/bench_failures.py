"""Failure handling figures for bench/RESULTS.md (issue 16): a frozen rank found by the hang
watchdog, a diverging run stopped by --max-skipped, a preemption resumed bitwise.

    python bench/bench_failures.py [--stall-only]
"""

import gzip
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import kill_resume  # noqa: E402
from nanomega import async_checkpoint, checkpoint  # noqa: E402


def hang(corpus, root, timeout=10):
    """Rank 1 of 2 stops itself (SIGSTOP) at step 3: seconds from its last logged step to the
    report."""
    out = root / "hang"
    job = kill_resume.torchrun(
        corpus,
        out,
        2,
        50,
        [
            "--inject-fault",
            "hang:1:3",
            "--hang-timeout",
            str(timeout),
            "--collective-timeout",
            "120",
        ],
        restarts=0,
    )
    workers, frozen_at = {}, None
    while not (out / "hang" / "report.txt").exists() and job.poll() is None:
        # both ranks: the first read may come before torchrun started the second
        if len(workers) < 2:
            workers = kill_resume.worker_pids(job.pid)
        if frozen_at is None and kill_resume.logged_step(out) >= 2:
            frozen_at = time.time()
        time.sleep(0.05)
    found = (out / "hang" / "report.txt").stat().st_mtime - frozen_at
    report = (out / "hang" / "report.txt").read_text().strip()
    os.kill(workers[1], signal.SIGKILL)
    job.communicate(timeout=120)
    return found, report, job.returncode


def diverge(corpus, root):
    """--lr 1e6 on the small model, default --max-skipped: the step it stops at and its exit
    code."""
    out = root / "lr1e6"
    cmd = [
        sys.executable,
        "nanomega/train.py",
        *kill_resume.MODEL,
        "--corpus",
        str(corpus),
        "--data-cache",
        str(root / "cache"),
        "--out-dir",
        str(out),
        "--max-steps",
        "60",
        "--lr",
        "1e6",
        "--save-every",
        "5",
    ]
    p = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    ckpts = sorted(os.listdir(out / "ckpt")) if (out / "ckpt").is_dir() else []
    return p.returncode, recs, p.stderr.strip().splitlines()[-1], ckpts


def async_stall(root, reps=7):
    """Seconds the training thread stops per save: synchronous save vs --async-save (the copy into
    the saver's reused buffers + thread start, and the step boundary that hands the manifest to a
    thread), interleaved so that other jobs on the cores disturb both alike; and the floor: one copy
    of the same bytes between two warm buffers (memory bandwidth). Returns a dict of medians."""
    import torch
    from nanomega.job import flags, saves
    from nanomega.job.guard import Spikes
    from nanomega import compose, dist, precision, windows

    # as each rank under torchrun; 2 threads on 2 shared cores: see bench/RESULTS.md
    torch.set_num_threads(1)
    a = flags.parse(
        [
            "--n-layer",
            "4",
            "--n-head",
            "4",
            "--n-embd",
            "256",
            "--block-size",
            "64",
            "--dropout",
            "0",
        ]
    )
    cfg = flags.model_config(a)
    dist.init("cpu")
    grid = dist.Grid(1, 1, 1)
    model, engine, n_params = compose.build(a, grid)
    x = torch.randint(0, cfg.vocab_size, (2, 64))
    model(x, x).backward()
    engine.step()  # Adam state exists: the shard holds master + m + v, 12 bytes per parameter
    sampler, scaler = windows.Sampler(1000, 16, 0), precision.LossScaler(dynamic=False)
    spikes = Spikes(a.on_spike, a.spike_threshold, a.rollback_lr_factor)
    out = str(root / "stall")
    saver = async_checkpoint.AsyncSaver(out, cfg, grid, {})
    nbytes = sum(
        t.numel() * t.element_size()
        for p in saves.rank_state(engine, sampler, scaler, 0, grid, spikes, copy=False)[
            "universal"
        ]["pieces"]
        for t in [p["master"], *p["state"].values()]
    )
    src, dst = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
    sync, stall, manifest, floor = [], [], [], []
    for i in range(reps):
        t0 = time.perf_counter()
        checkpoint.save(
            out, 2 * i + 1, cfg, saves.rank_state(engine, sampler, scaler, 0, grid, spikes), grid
        )
        sync.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        saver.start(
            2 * i + 2, saves.rank_state(engine, sampler, scaler, 0, grid, spikes, copy=False)
        )
        stall.append(time.perf_counter() - t0)
        # training goes on meanwhile; then a step boundary's poll() hands the manifest over
        saver.shard.result()
        t0 = time.perf_counter()
        saver.poll(lambda busy: busy)  # (the vote of every rank, here a world of one)
        manifest.append(time.perf_counter() - t0)
        stall[-1] += manifest[-1]
        saver.wait()  # the manifest written (in the background) before the next synchronous save
        t0 = time.perf_counter()
        dst.copy_(src)
        floor.append(time.perf_counter() - t0)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return dict(
        params=n_params,
        bytes=nbytes,
        sync=med(sync),
        stall=med(stall),
        first=stall[0],
        floor=med(floor),
        manifest=med(manifest),
        worst=max(s / y for s, y in zip(stall[1:], sync[1:])),
        reps=reps,
    )


def print_stall(r):
    print(
        f"save of {r['params'] / 1e6:.1f}M parameters ({r['bytes'] / 1e6:.0f} MB of tensors): synchronous "
        f"{1e3 * r['sync']:.0f} ms, --async-save stall {1e3 * r['stall']:.1f} ms = {100 * r['stall'] / r['sync']:.1f}% "
        f"(of which poll {1e3 * r['manifest']:.2f} ms; medians of {r['reps']}, interleaved; worst "
        f"reused-buffer save {100 * r['worst']:.1f}%); first save "
        f"(buffers allocated) {1e3 * r['first']:.1f} ms; floor, one copy of those bytes between warm buffers "
        f"{1e3 * r['floor']:.1f} ms = {r['bytes'] / r['floor'] / 1e9:.1f} GB/s"
    )


def main():
    root = Path(tempfile.mkdtemp(prefix="bench_failures-"))
    corpus = root / "small.txt"
    corpus.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(300_000))
    print_stall(async_stall(root))
    if sys.argv[1:] == ["--stall-only"]:
        return
    found, report, rc = hang(corpus, root)
    print(
        f"hang: rank 1 frozen at step 3 with --hang-timeout 10: reported after {found:.1f} s, exit {rc}\n  {report}"
    )
    rc, recs, last, ckpts = diverge(corpus, root)
    skipped = sum(r["skipped"] for r in recs)
    print(
        f"--lr 1e6, --max-skipped 20 (default): exit {rc} at step {recs[-1]['step']} of 60, {skipped} steps skipped; "
        f"checkpoints {ckpts}\n  {last}"
    )


if __name__ == "__main__":
    main()
