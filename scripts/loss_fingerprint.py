"""Fingerprint of every training layout the test suite runs: the exact losses (as float.hex) and a
checksum of the final full weights, written as JSON. Run it before and after a refactor that must
preserve behaviour, then diff:

    python scripts/loss_fingerprint.py before.json
    ... change the code ...
    python scripts/loss_fingerprint.py after.json && diff before.json after.json && echo bitwise-identical

Same machine, same thread counts (one per rank): the comparison is bitwise, not within a tolerance.
The layouts are tests/test_layouts.py's (4 and 8 ranks) plus 2-rank runs that cover the other engine
paths (ZeRO stages under bf16/fp16, clipping, weight decay, recompute, eager and fused attention,
gradient accumulation) and the Llama block's techniques (tp2 + SP, cp2 ring and Ulysses, experts over
ep2 and under ZeRO-2). ~2 min on 2 cores.
"""

import gzip
import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from nanomega import checkpoint, reshard, train, worlds  # noqa: E402
from test_layouts import COMMON, LAYOUTS_4, LAYOUTS_8  # noqa: E402

PAIR = ["--batch-size", "2", "--grad-accum", "2", "--grad-clip", "0.5", "--weight-decay", "0.1"]
LAYOUTS_2 = [
    ("dp2-zero0-bf16", [*PAIR, "--zero", "0", "--dtype", "bf16"]),
    ("dp2-zero1-fp16", [*PAIR, "--zero", "1", "--dtype", "fp16"]),
    (
        "dp2-zero2-bf16-selective",
        [*PAIR, "--zero", "2", "--dtype", "bf16", "--recompute", "selective"],
    ),
    ("dp2-zero3-fp16-full", [*PAIR, "--zero", "3", "--dtype", "fp16", "--recompute", "full"]),
    ("dp2-zero3-bf16-eager", [*PAIR, "--zero", "3", "--dtype", "bf16", "--attention", "eager"]),
    (
        "tp2-sp-zero1-fused",
        [*PAIR, "--tp", "2", "--sequence-parallel", "--fused", "--attention", "fused"],
    ),
    (
        "pp2-zero1-interleaved",
        [
            *PAIR,
            "--pp",
            "2",
            "--zero",
            "1",
            "--grad-accum",
            "4",
            "--virtual-stages",
            "2",
            "--schedule",
            "interleaved",
        ],
    ),
]
# the Llama block and the layouts of its techniques: context parallel, experts over ep
LLAMA = [*PAIR, "--arch", "llama", "--n-kv-head", "2"]
LAYOUTS_2 += [
    ("llama-tp2-sp-zero1", [*LLAMA, "--tp", "2", "--sequence-parallel", "--zero", "1"]),
    ("llama-cp2-ring-zero1", [*LLAMA, "--cp", "2", "--cp-method", "ring", "--zero", "1"]),
    ("llama-cp2-ulysses-zero0", [*LLAMA, "--cp", "2", "--cp-method", "ulysses", "--zero", "0"]),
    ("moe-ep2-zero1", [*LLAMA, "--n-experts", "4", "--top-k", "2", "--ep", "2", "--zero", "1"]),
    ("moe-dp2-zero2", [*LLAMA, "--n-experts", "4", "--top-k", "2", "--zero", "2"]),
]


def flags(corpus, out, extra):
    return [
        *COMMON,
        "--corpus",
        str(corpus),
        "--data-cache",
        str(Path(out).parent / "cache"),
        "--out-dir",
        str(out),
        *extra,
    ]


def run(corpus, root, layouts):
    for name, extra in layouts:
        train.main(flags(corpus, Path(root) / name, extra))
    return True


def fingerprint(out):
    recs = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    weights = reshard.full_weights(checkpoint.latest(out))
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].float().contiguous().numpy().tobytes())
    return {
        "losses": [float(r["loss"]).hex() for r in recs if "loss" in r],
        "val": float(recs[-1]["val_loss"]).hex(),
        "weights_sha256": h.hexdigest(),
    }


def main(path):
    root = Path(tempfile.mkdtemp(prefix="fingerprint-"))
    corpus = root / "small.txt"
    corpus.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(200_000))
    worlds.launch(
        run, 1, corpus, root, [("dense", ["--batch-size", "2", "--grad-accum", "4"])], timeout=600
    )
    for world, layouts in ((2, LAYOUTS_2), (4, LAYOUTS_4), (8, LAYOUTS_8)):
        worlds.launch(run, world, corpus, root, layouts, timeout=900)
    names = ["dense"] + [
        name for layouts in (LAYOUTS_2, LAYOUTS_4, LAYOUTS_8) for name, _ in layouts
    ]
    result = {name: fingerprint(root / name) for name in names}
    Path(path).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(result)} layouts -> {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fingerprint.json")
