"""Lesson 20 experiment: a spike rolled back, a preemption resumed bitwise, a corrupt checkpoint
skipped, a frozen rank named with stack dumps -- each on the small model, on CPU."""

import gzip
import io
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout

from check import check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import kill_resume  # noqa: E402
from nanomega import checkpoint, reshard, train  # noqa: E402

# 1. the failure law with BLOOM's reported rate, and the checkpoint interval that minimises lost
# work BLOOM: 384 GPUs, "1-2 GPU failures a week" as reported; 1.5 assumed here
gpus, per_week = 384, 1.5
mtbf_h = 7 * 24 / per_week
save_min = 2.0  # an assumed 2-minute synchronous save
young_h = math.sqrt(2 * save_min / 60 * mtbf_h)  # Young's interval: sqrt(2 x save cost x MTBF)
print(
    f"{gpus} GPUs, {per_week} failures/week: job MTBF {mtbf_h:.0f} h; with a {save_min:g}-min save, the interval "
    f"that minimises save time + lost work is sqrt(2 C M) = {young_h:.1f} h (BLOOM saved every 3 h)"
)
check("job MTBF in hours at 1.5 failures/week", mtbf_h, 112.0)
check("Young's checkpoint interval in hours (C = 2 min, M = 112 h)", round(young_h, 2), 2.73)

tmp = tempfile.mkdtemp()
corpus = os.path.join(tmp, "small.txt")
open(corpus, "w").write(
    gzip.open(os.path.join(ROOT, "data", "shakespeare.txt.gz"), "rt").read(300_000)
)
SMALL = [
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
    "--eval-every",
    "0",
    "--peak-flops",
    "1e11",
    "--save-every",
    "2",
    "--max-steps",
    "6",
    "--warmup",
    "2",
    "--corpus",
    corpus,
    "--data-cache",
    os.path.join(tmp, "cache"),
]


def run(name, *extra):
    """train.main in this process; returns (last record, what it printed on stderr)."""
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        rec = train.main([*SMALL, "--out-dir", os.path.join(tmp, name), *extra])
    return rec, err.getvalue()


def same(a, b):
    wa = reshard.full_weights(os.path.join(tmp, a, "ckpt", "step_000006"))
    wb = reshard.full_weights(os.path.join(tmp, b, "ckpt", "step_000006"))
    return int(all((wa[k] == wb[k]).all() for k in wa))


run("reference")

# 2. a loss spike at step 4, rolled back to step 2, the data of steps 3-4 skipped, lr halved
rec, err = run(
    "spike", "--inject-fault", "spike:0:4", "--on-spike", "rollback", "--rollback-lr-factor", "0.5"
)
print(err.strip().splitlines()[-1])
state = checkpoint.load_shard(os.path.join(tmp, "spike", "ckpt", "step_000006"), 0)["spikes"]
print(f"the step-6 checkpoint records {state}")
check("lr scale after one rollback with --rollback-lr-factor 0.5", state["lr_scale"], 0.5)
check(
    "data steps skipped by the rollback (recorded in the checkpoint)",
    sum(b - a + 1 for a, b in state["windows"]),
    2,
)

# 3. a preemption (SIGTERM) at step 3: checkpoint at the step boundary, exit 0; --resume ends
# bitwise equal
rec, err = run("preempted", "--inject-fault", "sigterm:0:3")
print(err.strip().splitlines()[-1])
run("preempted", "--resume")
check(
    "preempted at step 3 + resumed == uninterrupted, bitwise (1 = yes)",
    same("preempted", "reference"),
    1,
)

# 4. the newest checkpoint corrupted and its pointer lost: resume falls back and says why
shutil.copytree(
    os.path.join(tmp, "reference"),
    os.path.join(tmp, "corrupt"),
    ignore=shutil.ignore_patterns(".lock"),
)
shard = os.path.join(tmp, "corrupt", "ckpt", "step_000006", "rank_00000.pt")
open(shard, "r+b").write(b"bitrot")
os.remove(os.path.join(tmp, "corrupt", "ckpt", "latest"))
os.remove(os.path.join(tmp, "corrupt", "metrics.jsonl"))
rec, err = run("corrupt", "--resume")
print(err.strip().splitlines()[0].replace(tmp, "TMP"))
check(
    "corrupt step 6 skipped, resumed from step 4, retrained to step 6 == reference (1 = bitwise)",
    same("corrupt", "reference"),
    1,
)

# 5. a frozen rank: rank 1 of 2 stops itself (SIGSTOP) at step 3 under torchrun, --hang-timeout 5
out = os.path.join(tmp, "hang")
job = kill_resume.torchrun(
    corpus,
    out,
    2,
    50,
    ["--inject-fault", "hang:1:3", "--hang-timeout", "5", "--collective-timeout", "120"],
    restarts=0,
)
workers, report = {}, os.path.join(out, "hang", "report.txt")
while not os.path.exists(report) and job.poll() is None:
    workers = workers or kill_resume.worker_pids(job.pid)
    time.sleep(0.1)
print(open(report).read().strip().replace(out, "OUT"))
print(open(os.path.join(out, "hang", "rank_0.txt")).read().strip().splitlines()[0])
os.kill(workers[1], signal.SIGKILL)  # else torchrun waits 30 s before it kills the stopped rank
job.communicate(timeout=120)
check(
    "ranks named as frozen: rank 1 only (1 = yes)",
    int("ranks [1] did not answer" in open(report).read()),
    1,
)
