"""Lesson 10 experiment: the failure law, checkpoint bytes, and a real kill-and-resume under torchrun."""
import gzip
import os
import sys
import tempfile

from check import check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import kill_resume  # noqa: E402
from nanomega import checkpoint, reshard  # noqa: E402

# 1. the failure law: N devices, each failing independently with probability p per day
p, n = 1e-4, 1000
survive = (1 - p) ** n
print(f"P(a {n}-GPU job survives a day) = (1 - {p:g})^{n} = {survive:.3f}; mean time between failures "
      f"= 1 / (N p) = {1 / (n * p):.0f} days")
check("P(survive a day), 1000 GPUs at p=1e-4", round(survive, 4), 0.9048)

# 2. a real fault: SIGKILL rank 1 of a 2-rank ZeRO-1 job at step >= 5 of 10 under torchrun --max-restarts=3
tmp = tempfile.mkdtemp()
corpus = os.path.join(tmp, "small.txt")
open(corpus, "w").write(gzip.open(os.path.join(ROOT, "data", "shakespeare.txt.gz"), "rt").read(300_000))
same, killed, resumed, secs = kill_resume.trial(corpus, tmp, 2, 10, 5, 1, ["--zero", "1"])
print(f"killed rank 1: {killed}; the job restarted by itself and resumed {resumed}x; {secs:.0f} s in all")
check("final weights after kill + restart equal the uninterrupted run (1 = bitwise)", int(same and killed), 1)

# 3. what a checkpoint costs: fp32 master (4) + Adam m, v (8) = 12 bytes per parameter, split over ranks
folder = checkpoint.latest(os.path.join(tmp, "reference-0"))
n_params = sum(t.numel() for t in reshard.full_weights(folder).values())
size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".pt"))
print(f"checkpoint {folder.split(os.sep)[-1]}: {n_params:,} parameters, {size:,} bytes in 2 shards")
check("checkpoint bytes per parameter vs 4 + 8 (master + Adam)", size / n_params, 12.0, rtol=0.05)
