"""ZeRO++ against plain ZeRO-3 at dp 4 (2 hosts of 2 ranks: --dp-shard 2 names the host size):
README's model and data, global batch 32 x 128 as bench/onebit_convergence.py's rows (whose SCHEMES
table holds these rows too), the schedule cut to 100 steps (a stated smaller equivalent: 4 ranks of
README's model take ~8 min per run on 2 shared cores).

    python bench/zeropp_convergence.py [--steps 100] [--only NAME ...] [--figure PATH]

Writes bench/out/zeropp/<scheme>/metrics.jsonl, the markdown table (bench/RESULTS.md) and
bench/out/zeropp/loss.png (scripts/figures.py: lesson 17's 17_loss_zeropp.png).
"""

from pathlib import Path

import onebit_convergence

ROWS = ["zero3-dp4", "qwz8", "qgz8", "hpz", "zeropp-all"]

if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "out" / "zeropp"
    onebit_convergence.main(rows=ROWS, steps=100, out=out)
