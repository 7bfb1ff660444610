"""Lesson 19 experiment: the failure law, checkpoint bytes, and a real kill-and-resume under
torchrun."""

import gzip
import os
import sys
import tempfile

from check import check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import kill_resume  # noqa: E402
from nanomega import checkpoint, reshard  # noqa: E402

# 1. the failure law: N devices, each failing independently with probability p per day. Two
# published rates:
#    BLOOM: "1-2 GPU failures a week" on a cluster of "about 400 GPUs" (BigScience, The Technology Behind
#    BLOOM Training, 2022), counted over the job's 384: 1.5 / 7 / 384 = 5.6e-4 per GPU per day; DLRover's
#    0.27% per GPU per day ("about 8% per card in a month", docs/blogs/stabilize_llm_training_cn.md).
import math  # noqa: E402

n = 1000
for name, p in (("BLOOM, 1.5 a week on 384 GPUs", 1.5 / 7 / 384), ("DLRover, 0.27%", 0.0027)):
    survive = (1 - p) ** n
    print(
        f"{name}: p = {p:.2g} per GPU per day; P(a {n}-GPU job survives a day) = (1 - p)^{n} = {survive:.3f}; "
        f"mean time between failures = 1 / (N p) = {24 / (n * p):.1f} hours"
    )
p = 1.5 / 7 / 384
# (1-p)^N = exp(N ln(1-p)) = exp(-Np - Np^2/2 - ...): the Poisson form exp(-Np) is off by at most ~
# N p^2
check(
    "P(survive a day), 1000 GPUs at BLOOM's rate",
    (1 - p) ** n,
    math.exp(-n * p),
    atol=n * p * p,
    labels=("(1-p)^N", "exp(-Np)"),
)

# 2. a real fault: SIGKILL rank 1 of a 2-rank ZeRO-1 job at step >= 5 of 10 under torchrun
# --max-restarts=3
tmp = tempfile.mkdtemp()
corpus = os.path.join(tmp, "small.txt")
open(corpus, "w").write(
    gzip.open(os.path.join(ROOT, "data", "shakespeare.txt.gz"), "rt").read(300_000)
)
same, killed, resumed, secs = kill_resume.trial(corpus, tmp, 2, 10, 5, 1, ["--zero", "1"])
print(
    f"killed rank 1: {killed}; the job restarted by itself and resumed {resumed}x; {secs:.0f} s in all"
)
check(
    "final weights after kill + restart equal the uninterrupted run (1 = bitwise)",
    int(same and killed),
    1,
)

# 3. what a checkpoint costs: fp32 master (4) + Adam m, v (8) = 12 bytes per parameter, split over
# ranks
folder = checkpoint.latest(os.path.join(tmp, "reference-0"))
n_params = sum(t.numel() for t in reshard.full_weights(folder).values())
size = sum(
    os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".pt")
)
print(f"checkpoint {folder.split(os.sep)[-1]}: {n_params:,} parameters, {size:,} bytes in 2 shards")
check("checkpoint bytes per parameter vs 4 + 8 (master + Adam)", size / n_params, 12.0, rtol=0.05)
