"""Step time on a slow inter-host link: 2 hosts x 1 rank (scripts/local_cluster.sh: network
namespaces joined by veth cables), host 1's cable capped by tc's token bucket (--slow-link), each
scheme a row of SCHEMES; the measured step times beside the alpha-beta prediction of the difference
(the bytes that cross, formulas below, at the capped rate; compute is the same in every row).

    python bench/slow_link.py [--rate 20mbit]      # needs root and iproute2; ~6 min on 2 shared cores

README's model (1.33M parameters) at dp 2: AdamW all-reduces 2 (N-1)/N x 4 n bytes per rank per
step; 1-bit Adam after its warm-up onebit.wire_bytes(n, N). A step's time is the meter's
(tokens per step / tok_s), the median over the steps after FROM (1-bit Adam's warm-up is over).
"""

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

from nanomega import onebit  # noqa: E402
from nanomega.job import flags  # noqa: E402
from nanomega.model import GPT  # noqa: E402

VOCAB = 4096  # the repository's tokenizer (README)

STEPS, FROM = 12, 5
SCHEMES = {
    "uncompressed (AdamW)": [],
    "1-bit Adam": ["--optimizer", "onebit", "--onebit-warmup", "3"],
}


def n_params():
    """README's model's parameters (the gradient elements a stage-0 step moves)."""
    with torch.device("meta"):
        model = GPT(flags.model_config(flags.parse(["--out-dir", "unused"]), VOCAB))
    return sum(p.numel() for p in model.parameters())


def step_times(corpus, out, flags, rate):
    args = ["--max-steps", str(STEPS), "--eval-every", "0", "--log-every", "1", *flags]
    args += ["--corpus", str(corpus), "--out-dir", str(out), "--data-cache", str(out / "cache")]
    job = subprocess.run(
        ["bash", "scripts/local_cluster.sh", "2", "1", "--slow-link", f"1:{rate}", "--", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if job.returncode:
        sys.exit(f"local_cluster.sh exited {job.returncode}: {job.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    return [
        r["tokens"] / r["step"] / r["tok_s"] for r in rows if r.get("tok_s") and r["step"] > FROM
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="20mbit", help="tc tbf rate of host 1's cable")
    a = p.parse_args()
    bits = float(a.rate.rstrip("mbit")) * 1e6
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "small.txt"
        corpus.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(200_000))
        measured = {}
        for i, (name, flags) in enumerate(SCHEMES.items()):
            times = step_times(corpus, Path(tmp) / str(i), flags, a.rate)
            measured[name] = statistics.median(times)
    n = n_params()
    across = {
        "uncompressed (AdamW)": 2 * (2 - 1) / 2 * 4 * n,
        "1-bit Adam": onebit.wire_bytes(n, 2),
    }
    print(f"2 hosts x 1 rank, host 1's cable at {a.rate} (tc tbf), steps {FROM + 1}-{STEPS}:")
    for name, t in measured.items():
        b = across[name]
        print(
            f"  {name:<22} {t:7.3f} s/step measured; {b / 1e6:6.3f} MB across, {8 * b / bits:6.3f} s at the rate"
        )
    names = list(SCHEMES)
    saved = measured[names[0]] - measured[names[1]]
    predicted = 8 * (across[names[0]] - across[names[1]]) / bits
    print(f"  saved per step: measured {saved:.3f} s, predicted (bytes / rate) {predicted:.3f} s")


if __name__ == "__main__":
    main()
