"""What crosses the slow link, on 2 hosts x 2 ranks (scripts/local_cluster.sh: network namespaces
joined by veth cables): for each scheme (hybrid sharding, ZeRO++'s hpZ, qwZ 8, qgZ 8 and all three,
1-bit Adam) against plain ZeRO-3 over dp 4, the bytes host 1's cable sent per step, counted by the
kernel (its eth0's tx_bytes), beside the formula; with --rate, the step time with that cable
capped by tc's token bucket (--slow-link 1:RATE).

    python bench/hybrid_link.py [--only NAME ...]   # bytes; root + iproute2; 14 runs, ~36 min loaded
    python bench/hybrid_link.py --rate 50mbit       # step times, host 1's cable capped; ~25 min

Per step = (bytes sent after LONG steps - after SHORT steps) / (LONG - SHORT): start-up, the
rendezvous and the final save cancel. The formula is the engine's own (train.py --dry-run:
formulas.zeropp_comm_bytes / hybrid_comm_bytes per rank, onebit.wire_bytes), turned into what one
host's cable carries. gloo runs an axis's all-gather as a ring in rank order (0 -> 1 -> 2 -> 3 ->
0): of host 1's two ranks only rank 3 sends across, one rank's ring share. An
axis of two ranks on two hosts (hybrid's replicas, qgZ's second all-to-all) and an all-to-all's
chunks for the other host leave from both ranks:
    plain ZeRO-3, hpZ, qwZ   cable = one rank's "across" (every across collective is a dp 4 ring)
                             + (N-1)/N P 4 per micro-batch: gloo's reduce-scatter moves what an
                             all-reduce moves, twice the ring's (measured: the 8.1 MB per step
                             these three rows had above the ring's formula, and no other row)
    qgZ                      cable = the gathers' ring share + 2 x each rank's all-to-all across
    hybrid                   cable = 2 x each rank's "across" (the replicas' all-reduce)
    1-bit Adam (after its warm-up, one buffer of n_pad elements, N = 4 ranks, k = n_pad / 8N + 4):
                             cable = 2 ranks x 2 chunks k (all-to-all) + (N - 1) k (ring all-gather)
The kernel's counter also holds the TCP/IP headers, host 1's ACKs of what host 0 sends it and the
job's other cross-host traffic (the loss's all-reduce, the store's keys): measured / formula is a
little above 1, never below; the fixed part (measured - formula per step) is printed.
"""

import argparse
import contextlib
import gzip
import io
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

from nanomega import formulas, onebit, train  # noqa: E402
from nanomega.job import checks, flags  # noqa: E402
from nanomega.tools import cost_link  # noqa: E402
from nanomega.model import GPT  # noqa: E402

VOCAB = 4096  # the repository's tokenizer (README)

SHORT, LONG = 2, 6
TIMED, FROM = 8, 2  # --rate: TIMED steps, the step time the min over the steps after FROM
MODEL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "64"]
RUN = ["--batch-size", "1", "--grad-accum", "2", "--eval-every", "0"]
RUN += ["--log-every", "1", "--warmup", "1", "--lr", "1e-3"]
Z3 = ["--zero", "3", "--dp-shard", "2"]  # ZeRO++: --dp-shard names the host size
LAYOUTS = {
    "plain ZeRO-3, dp 4": ["--zero", "3"],
    "hybrid 2 x 2": [*Z3],
    "hpZ": [*Z3, "--zeropp-hpz"],
    "qwZ 8": [*Z3, "--zeropp-qwz", "8"],
    "qgZ 8": [*Z3, "--zeropp-qgz", "8"],
    "hpZ + qwZ 8 + qgZ 8": [*Z3, "--zeropp-hpz", "--zeropp-qwz", "8", "--zeropp-qgz", "8"],
    "1-bit Adam": ["--zero", "0", "--optimizer", "onebit", "--onebit-warmup", "1"],
}
M = 2  # --grad-accum: ZeRO-3 gathers and reduces once per micro-batch


def cluster(corpus, out, extra, steps, rate=None):
    """One run of `steps` steps on 2 hosts x 2 ranks: (bytes host 1's cable sent, step times)."""
    args = [*MODEL, *RUN, *extra, "--max-steps", str(steps), "--corpus", str(corpus)]
    args += ["--out-dir", str(out), "--data-cache", str(out.parent / "cache")]
    cap = ["--slow-link", f"1:{rate}"] if rate else []
    job = subprocess.run(
        ["bash", str(ROOT / "scripts" / "local_cluster.sh"), "2", "2", *cap, "--", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if job.returncode:
        sys.exit(f"local_cluster.sh exited {job.returncode}: {job.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if line.strip()]
    times = [r["tokens"] / r["step"] / r["tok_s"] for r in rows if r.get("tok_s")]
    sent = int(re.search(r"host 1's cable: sent (\d+) bytes", job.stderr).group(1))
    return sent, [t for r, t in zip([r for r in rows if r.get("tok_s")], times) if r["step"] > FROM]


def dry_run(extra, rank):
    """The engine's own per-rank numbers: (its links, the padded group sizes ZeRO++ prices)."""
    sizes, price = [], formulas.zeropp_comm_bytes

    def spy(groups, *a, **kw):  # the groups the dry run hands the formula
        sizes[:] = groups
        return price(groups, *a, **kw)

    formulas.zeropp_comm_bytes = spy
    try:
        argv = [*MODEL, *RUN, *extra, "--dry-run", "--world", "4", "--rank", str(rank)]
        with contextlib.redirect_stdout(io.StringIO()):  # its report: the numbers are returned
            return train.main(argv)["links"], sizes
    finally:
        formulas.zeropp_comm_bytes = price


def n_params():
    """The model's parameters (1-bit Adam averages their momentum as one buffer)."""
    with torch.device("meta"):
        model = GPT(flags.model_config(flags.parse([*MODEL, "--out-dir", "unused"]), VOCAB))
    return sum(p.numel() for p in model.parameters())


def cable(name):
    """Bytes per step host 1's cable carries by the formula (the docstring's table)."""
    extra = LAYOUTS[name]
    if name == "1-bit Adam":
        k = onebit.padded(n_params(), 4) / 8 / 4 + 4
        return 2 * 2 * k + 3 * k
    plain = name == "plain ZeRO-3, dp 4"  # hpZ's dry run prices it over the same padded groups
    ((_, across), everything), sizes = dry_run(LAYOUTS["hpZ"] if plain else extra, 3)
    if name == "hybrid 2 x 2":
        return 2 * across
    across = everything if plain else across
    qgz = int(extra[extra.index("--zeropp-qgz") + 1]) if "--zeropp-qgz" in extra else 0
    a2a = sum(M * formulas.quantized_bytes(p // 4, qgz) for p in sizes) if qgz else 0.0
    gloo = 0.0 if qgz else M * 3 / 4 * sum(sizes) * 4  # its reduce-scatter: an all-reduce's bytes
    return across + a2a + gloo  # the rings' share once, the all-to-all from both ranks


def planner(name, mbit):
    """tools/cost_link's seconds of communication for this row on a cable of `mbit` Mbit/s (the
    step's compute left out: --compute-s 0), its other links at their defaults."""
    argv = ["--world", "4", *MODEL, *RUN]
    config = checks.check(flags.parse([*argv, *LAYOUTS[name], "--dry-run"]))
    scheme = cost_link.Scheme.of(config)
    return cost_link.predict(argv, scheme, cost_link.Network.capped(2, mbit)).comm_s


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--rate", help="cap host 1's cable (tc tbf, e.g. 100mbit): step times")
    p.add_argument("--planner", type=float, help="only the planner's column at this Mbit/s")
    a = p.parse_args()
    if a.planner:
        for name in a.only:
            print(f"| {name} | planner {planner(name, a.planner):.3f} s |")
        return
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "small.txt"
        corpus.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(200_000))
        rows = {}
        for i, name in enumerate(a.only):
            extra = LAYOUTS[name]
            if a.rate:
                sent, times = cluster(corpus, Path(tmp) / f"{i}", extra, TIMED, a.rate)
                rows[name] = (min(times), sent)
            else:
                short, long = (
                    cluster(corpus, Path(tmp) / f"{i}-{s}", extra, s)[0] for s in (SHORT, LONG)
                )
                rows[name] = (long - short) / (LONG - SHORT)
    load = open("/proc/loadavg").read().split()[:3]
    if a.rate:
        print(f"host 1's cable at {a.rate} (tc tbf), steps {FROM + 1}-{TIMED}, load {load}:")
        head = (
            "| scheme | MB across / step | bytes / rate (s) | measured s/step (min) | measured - "
        )
        print(head + "bytes / rate (s) | planner (s) |\n|---|---|---|---|---|---|")
        bits = (
            float(re.match(r"[\d.]+", a.rate).group())
            * {"k": 1e3, "m": 1e6, "g": 1e9}[a.rate.rstrip("bit")[-1]]
        )
        for name, (t, _) in rows.items():
            b = cable(name)
            s = 8 * b / bits
            p_s = planner(name, bits / 1e6)
            print(f"| {name} | {b / 1e6:.3f} | {s:.3f} | {t:.3f} | {t - s:.2f} | {p_s:.3f} |")
        return
    print(f"bytes host 1's cable sends per step ({SHORT} -> {LONG} steps), load {load}:")
    print("| scheme | formula (B) | kernel tx_bytes (B) | measured / formula | fixed part (B) |")
    print("|---|---|---|---|---|")
    for name, measured in rows.items():
        b = cable(name)
        print(f"| {name} | {b:,.0f} | {measured:,.0f} | {measured / b:.3f} | {measured - b:,.0f} |")
        assert 1.0 <= measured / b < 1.15, (
            f"{name}: the cable carried {measured / b:.3f} x the formula"
        )


if __name__ == "__main__":
    main()
