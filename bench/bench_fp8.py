"""FP8 training on this CPU: the loss after N steps and the step time, fp32 and bf16 against each
--fp8 recipe, with and without an injected outlier channel (the divergence lab of lesson 10).

    python bench/bench_fp8.py --steps 200            # one process; prints a markdown table

The outlier: every block linear's input channel 0 is multiplied by 2^16 (the same change in the
fp32 run and in each recipe: a model with an outlier channel). The FP8 casts then see a channel
2^16 x larger than the rest: a scale shared with it (tensorwise: the whole tensor; rowwise: the
token's row) pushes the other channels into E4M3's subnormals, a scale per 1 x 16 tile (blockwise
here) or 1 x 32 block (MX) keeps them. The step time is the median over the run's steps after
the first 5 (FP8 on this CPU is emulated or runs _scaled_mm's CPU kernel: it is slower than fp32
here; no GPU speed is claimed).
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

import torch.nn.functional as F  # noqa: E402

from nanomega import fp8_linear, train  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# off: fp32; bf16: --dtype bf16 without FP8 (the precision FP8 is usually weighed against)
RECIPES = ["off", "bf16", "tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"]
OUTLIER = 2.0**16  # lesson 10: below ~2^12, E4M3's subnormals absorb an outlier channel
SHAPE = "--n-layer 2 --n-head 4 --n-embd 64 --block-size 64 --batch-size 8 --dropout 0".split()


def with_outlier(apply_fp8):
    """compose's FP8 step, then every block's linear entry (FP8 or F.linear) fed an input whose
    channel 0 is OUTLIER times larger: the same model for fp32 and each recipe."""

    def apply(model, *args, **kw):
        entry = apply_fp8(model, *args, **kw) or F.linear

        def linear(x, weight, bias=None):
            x = x.clone()
            x[..., 0] *= OUTLIER
            return entry(x, weight, bias)

        model.replace_op("linear", linear, blocks=list(model.blocks.keys()))
        return entry

    return apply


def run(name, steps, outlier, root, corpus):
    out = root / f"{name}-{int(outlier)}"
    argv = [*SHAPE, "--max-steps", str(steps), "--warmup", "10", "--lr", "3e-3"]
    argv += ["--eval-every", str(steps), "--eval-iters", "4", "--log-every", "1000"]
    argv += ["--corpus", str(corpus), "--data-cache", str(root / "cache"), "--out-dir", str(out)]
    if name == "bf16":
        argv += ["--dtype", "bf16"]
    elif name != "off":
        argv += ["--fp8", name, "--fp8-block", "16"]
    apply_fp8 = fp8_linear.apply_fp8
    if outlier:
        fp8_linear.apply_fp8 = with_outlier(apply_fp8)
    try:
        start = time.perf_counter()
        train.main(argv)
        wall = time.perf_counter() - start
    finally:
        fp8_linear.apply_fp8 = apply_fp8
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
        for outlier in (False, True):
            r = run(name, args.steps, outlier, root, corpus)
            rows.append((name, outlier, r))
            print(json.dumps(dict(recipe=name, outlier=outlier, **r)), flush=True)
    print(f"\n| recipe | outlier channel | loss @ {args.steps} | val @ {args.steps} | ms/step |")
    print("|---|---|---|---|---|")
    for name, outlier, r in rows:
        o = "x 2^16" if outlier else "-"
        print(f"| {name} | {o} | {r['loss']:.4f} | {r['val']:.4f} | {r['ms']:.1f} |")


if __name__ == "__main__":
    main()
