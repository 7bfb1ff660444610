"""FP8 training on this CPU: the loss after N steps and the step time, fp32 against each --fp8
recipe, with and without an injected outlier channel (the divergence lab of lesson 20).

    python bench/bench_fp8.py --steps 200            # one process; prints a markdown table

The outlier: every FP8 linear's input channel 0 is multiplied by 2^10 and the weight's column 0
divided by 2^10 before the entry (exact in binary floating point: the product X W^T is unchanged,
so the fp32 run is the same run). The FP8 casts see a channel 1024x larger than the rest: a scale
shared with it (tensorwise: the whole tensor; rowwise: the token's row) pushes the other channels
toward E4M3's subnormals and zero, a scale per 1 x 16 tile (blockwise here) or 1 x 32 block (MX)
keeps them. The step time is the median over the run's steps after the first 5 (FP8 on this CPU is
emulated or runs _scaled_mm's CPU kernel: it is slower than fp32 here; no GPU speed is claimed).
"""

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanomega import fp8_linear, train  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ["off", "tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"]
OUTLIER = 2.0**10
SHAPE = "--n-layer 2 --n-head 4 --n-embd 64 --block-size 64 --batch-size 8 --dropout 0".split()


def with_outlier(call):
    """The entry with input channel 0 x 2^10 and weight column 0 / 2^10 (the same product)."""

    def outlier_call(self, x, weight, bias=None):
        x = x.clone()
        x[..., 0] *= OUTLIER
        weight = weight.clone()
        weight[:, 0] /= OUTLIER
        return call(self, x, weight, bias)

    return outlier_call


def run(name, steps, outlier, root, corpus):
    out = root / f"{name}-{int(outlier)}"
    argv = [*SHAPE, "--max-steps", str(steps), "--warmup", "10", "--lr", "3e-3"]
    argv += ["--eval-every", str(steps), "--eval-iters", "4", "--log-every", "1000"]
    argv += ["--corpus", str(corpus), "--data-cache", str(root / "cache"), "--out-dir", str(out)]
    argv += ["--fp8", name, "--fp8-block", "16"] if name != "off" else []
    call = fp8_linear.FP8.__call__
    if outlier:
        fp8_linear.FP8.__call__ = with_outlier(call)
    try:
        start = time.perf_counter()
        train.main(argv)
        wall = time.perf_counter() - start
    finally:
        fp8_linear.FP8.__call__ = call
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    times = [8 * 64 / r["tok_s"] for r in recs if "tok_s" in r][5:]  # batch x block tokens a step
    losses = [r["loss"] for r in recs if "loss" in r]
    return dict(
        loss=losses[-1], val=recs[-1]["val_loss"], ms=1e3 * statistics.median(times), wall=wall
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--recipes", default=",".join(RECIPES))
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_fp8_"))
    corpus = root / "corpus.txt"
    corpus.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(1_000_000))
    rows = []
    for name in args.recipes.split(","):
        for outlier in (False, True) if name != "off" else (False,):
            r = run(name, args.steps, outlier, root, corpus)
            rows.append((name, outlier, r))
            print(json.dumps(dict(recipe=name, outlier=outlier, **r)), flush=True)
    print(f"\n| recipe | outlier channel | loss @ {args.steps} | val @ {args.steps} | ms/step |")
    print("|---|---|---|---|---|")
    for name, outlier, r in rows:
        o = "x 2^10" if outlier else "-"
        print(f"| {name} | {o} | {r['loss']:.4f} | {r['val']:.4f} | {r['ms']:.1f} |")


if __name__ == "__main__":
    main()
