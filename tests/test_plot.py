"""nanomega/tools/plot.py: PNGs of real runs (a pp=2 run overlaid on the dense one) and the pipeline
timeline that train.py records for step 1."""

import gzip
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")

from nanomega import train, worlds  # noqa: E402
from nanomega.tools import plot

ROOT = Path(__file__).resolve().parent.parent
FLAGS = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "2",
    "--grad-accum",
    "4",
    "--eval-every",
    "2",
    "--eval-iters",
    "1",
    "--peak-flops",
    "1e11",
    "--max-steps",
    "3",
]


def run(corpus, out, extra):
    train.main(
        [
            *FLAGS,
            "--corpus",
            str(corpus),
            "--data-cache",
            str(Path(out).parent / "cache"),
            "--out-dir",
            str(out),
            *extra,
        ]
    )
    return True


def test_plots_of_a_pipeline_run_and_the_dense_one(tmp_path):
    corpus = tmp_path / "small.txt"
    corpus.write_text(gzip.open(ROOT / "data" / "shakespeare.txt.gz", "rt").read(100_000))
    run(corpus, tmp_path / "dense", [])
    worlds.launch(run, 2, corpus, tmp_path / "pp2", ["--pp", "2"], timeout=240)
    traces = plot.read_traces(tmp_path / "pp2")
    assert [t.rank for t in traces] == [0, 1]
    # step 1 under 1F1B: each stage ran every micro-batch forward and backward once
    for t in traces:
        assert sorted((e.op, e.mb) for e in t.events) == sorted(
            (op, i) for op in "FB" for i in range(4)
        )
    train_rows, vals = plot.read_run(tmp_path / "pp2")
    assert [r["step"] for r in train_rows] == [1, 2, 3] and [r["tokens"] for r in train_rows] == [
        256,
        512,
        768,
    ]
    assert [r["step"] for r in vals] == [0, 2, 3]
    written = plot.plot([tmp_path / "dense", tmp_path / "pp2"], tmp_path / "plots")
    assert sorted(Path(p).name for p in written) == [
        "loss.png",
        "throughput.png",
        "timeline_pp2.png",
    ]
    for p in written:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Path(p).stat().st_size > 10_000
    with pytest.raises(FileNotFoundError, match="has no metrics.jsonl"):
        plot.read_run(tmp_path)
