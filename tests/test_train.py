"""The trainer end to end: exact resume, metrics, and one clear line for each kind of bad input."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import forkrun

from nanomega import checkpoint, reshard, train

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--grad-accum",
    "2",
    "--eval-every",
    "3",
    "--eval-iters",
    "2",
    "--warmup",
    "2",
    "--peak-flops",
    "1e11",
    "--dropout",
    "0.1",
    "--log-every",
    "100",
]


def run(corpus, out, *extra):
    return train.main(
        [
            *SMALL,
            "--corpus",
            str(corpus),
            "--data-cache",
            str(out.parent / "cache"),
            "--out-dir",
            str(out),
            *extra,
        ]
    )


def final_weights(out):
    return reshard.full_weights(checkpoint.latest(out))


def test_exact_resume(corpus, tmp_path):
    """6 steps straight == 3 steps, save, resume, 3 more: bitwise (fp32, CPU, dropout on)."""
    straight = tmp_path / "straight"
    rec = run(corpus, straight, "--max-steps", "6", "--save-every", "3")
    assert rec["step"] == 6 and "val_loss" in rec
    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(straight / "ckpt" / "step_000003", resumed / "ckpt" / "step_000003")
    (resumed / "ckpt" / "latest").write_text("step_000003")
    run(corpus, resumed, "--max-steps", "6", "--save-every", "3", "--resume")
    a, b = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    losses = lambda out: [
        r["loss"] for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r
    ]
    assert losses(straight)[3:] == losses(resumed)
    assert not torch.equal(
        a["embed.wte.weight"],
        reshard.full_weights(straight / "ckpt" / "step_000003")["embed.wte.weight"],
    )  # it did train


def test_resume_without_checkpoint_starts_fresh(corpus, tmp_path):
    rec = run(corpus, tmp_path / "fresh", "--max-steps", "1", "--resume")
    assert rec["step"] == 1


def bad_inputs(tmp):
    corrupt = tmp / "corrupt.txt.gz"
    corrupt.write_bytes(b"\x1f\x8b\x08\x00garbage")
    tiny = tmp / "tiny.txt"
    tiny.write_text("To be, or not to be.\n" * 5)
    return [
        (["--n-layer", "0"], "--n-layer must be >= 1"),
        (["--n-embd", "100", "--n-head", "3"], "--n-embd 100 is not divisible by --n-head 3"),
        (["--lr", "-1"], "--lr must be > 0"),
        (["--corpus", str(tmp / "missing.txt")], "does not exist"),
        (["--corpus", str(corrupt)], str(corrupt)),
        (["--corpus", str(tiny), "--block-size", "512"], "--block-size 512 is larger than"),
        (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
        (["--tokenizer", "gpt5"], "--tokenizer"),
    ]


def test_bad_input_one_clear_line(tmp_path):
    """Each bad input is its own `nanomega/train.py` process (exit 2, one line on stderr), all
    started at once as forks of one process that imported torch and nanomega (tests/forkrun.py: a
    refusal was mostly an interpreter's start, ~26 s of the suite on CI one at a time). Each run
    has its own out-dir and cache."""
    cases = bad_inputs(tmp_path)
    server = forkrun.Server()
    try:
        results = server.run(
            [
                (
                    [*args, "--out-dir", str(tmp_path / f"o{i}"), "--data-cache"]
                    + [str(tmp_path / f"c{i}")],
                    dict(os.environ),
                )
                for i, (args, _) in enumerate(cases)
            ],
            timeout=240,
        )
    finally:
        server.close()
    for (rc, err, _, _), (args, message) in zip(results, cases):
        err = err.strip().splitlines()
        assert rc == 2, (args, err)
        assert len(err) == 1 and message in err[0], (args, err)


def test_resume_refuses_other_shape_and_keeps_files(corpus, tmp_path):
    out = tmp_path / "run"
    run(corpus, out, "--max-steps", "1")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="another model shape: n_layer=2 \\(now 3\\)"):
        run(corpus, out, "--max-steps", "2", "--resume", "--n-layer", "3")
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        run(corpus, out, "--max-steps", "2")
    # nothing overwritten
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
