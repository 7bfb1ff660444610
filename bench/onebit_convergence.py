"""Convergence of the communication schemes against the uncompressed run: README's model and data
(1.33M-parameter GPT, Shakespeare, global batch 32 x 128), its schedule cut to STEPS steps, each
scheme a row of SCHEMES (its world size and flags); the loss curves side by side.

    python bench/onebit_convergence.py [--steps 200] [--only NAME ...]   # ~20 min on 2 shared cores

Writes bench/out/convergence/<scheme>/metrics.jsonl, a markdown table of train/val loss every
EVERY steps (bench/RESULTS.md takes it) and bench/out/convergence/loss.png (tools/plot.py's
figure, the runs overlaid). ZeRO++'s rows (4 ranks) run apart: bench/zeropp_convergence.py.
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from nanomega.tools import plot  # noqa: E402

ZPP = ["--zero", "3", "--dp-shard", "2", "--batch-size", "8"]
# name -> (ranks, flags): the same global batch in every row, so the same samples per step
SCHEMES = {
    "uncompressed": (2, []),
    "onebit": (2, ["--optimizer", "onebit", "--onebit-warmup", "40"]),  # 20% of 200 steps
    "onebit-w100": (2, ["--optimizer", "onebit", "--onebit-warmup", "100"]),
    # 4 ranks: --batch-size 8 keeps the global batch at 32 (RESULTS.md's run of 2026-11-28 left it
    # at 16 per rank, 64 per step: its row is not like for like)
    "hybrid-2x2": (4, ["--zero", "1", "--dp-shard", "2", "--batch-size", "8"]),
    # ZeRO++ (2 hosts of 2 ranks: --dp-shard names the host size) against plain ZeRO-3 at dp 4
    "zero3-dp4": (4, ["--zero", "3", "--batch-size", "8"]),
    "qwz8": (4, [*ZPP, "--zeropp-qwz", "8"]),
    "qgz8": (4, [*ZPP, "--zeropp-qgz", "8"]),
    "hpz": (4, [*ZPP, "--zeropp-hpz"]),
    "zeropp-all": (4, [*ZPP, "--zeropp-hpz", "--zeropp-qwz", "8", "--zeropp-qgz", "8"]),
}
EVERY = 25


def run(name, steps, out):
    ranks, flags = SCHEMES[name]
    args = ["--out-dir", str(out / name), "--max-steps", str(steps), "--eval-every", str(EVERY)]
    args += ["--log-every", "1", *flags]
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={ranks}", "nanomega/train.py", *args]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)


def table(names, out):
    """Train loss (mean of the EVERY steps ending there) and val loss per scheme, every EVERY."""
    runs = {n: plot.read_run(out / n) for n in names}
    head = "| step | " + " | ".join(f"{n} train | {n} val" for n in names) + " |"
    rows = [head, "|" + "---|" * (1 + 2 * len(names))]
    last = max(r["step"] for train, _ in runs.values() for r in train)
    for step in range(EVERY, last + 1, EVERY):
        cells = []
        for n in names:
            train, vals = runs[n]
            window = [r["loss"] for r in train if step - EVERY < r["step"] <= step]
            val = [r["val_loss"] for r in vals if r["step"] == step]
            cells += [f"{sum(window) / len(window):.4f}" if window else "-"]
            cells += [f"{val[0]:.4f}" if val else "-"]
        rows.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


ONEBIT = ["uncompressed", "onebit", "onebit-w100", "hybrid-2x2"]


def main(argv=None, rows=ONEBIT, steps=200, out=ROOT / "bench" / "out" / "convergence"):
    """rows, steps, out: the defaults (bench/zeropp_convergence.py passes ZeRO++'s)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--only", nargs="*", default=rows, choices=list(SCHEMES))
    p.add_argument("--out", default=str(out))
    p.add_argument("--figure", help="also copy the loss figure there (scripts/figures.py's)")
    a = p.parse_args(argv)
    out = Path(a.out)
    for name in a.only:
        if not (out / name / "metrics.jsonl").is_file():
            run(name, a.steps, out)
    names = [n for n in SCHEMES if (out / n / "metrics.jsonl").is_file()]
    print(table(names, out))
    plot.main([*(str(out / n) for n in names), "--to", str(out)])
    if a.figure:
        shutil.copyfile(out / "loss.png", a.figure)


if __name__ == "__main__":
    main()
