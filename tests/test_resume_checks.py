"""Issue 43: what a resume checks, and a skipped step skips everything that learns.

One small MoE run (Llama, 4 experts, DeepSeek-V3's bias balancing, a checkpoint every step) whose
step 2 is NaN (--inject-fault nan:0:2, skipped by the engine):
    bias       the routing bias after the skipped step is bitwise the bias before it, and it moved on
               the steps taken (the test could tell); before the fix update_bias ran on every step
    --router   a resume under another --router is refused in one line by the command, nothing
               written; --allow-arithmetic-change accepts it; every ARITHMETIC option is compared
The loss scaler, the other state a step changes besides the engine's, is meant to learn from a
non-finite step (it lowers the scale: precision.LossScaler, tests/test_precision.py).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanomega import checkpoint, data, moe, train
from nanomega.job import checks, faults, flags, saves

ROOT = Path(__file__).resolve().parent.parent
CORPUS_CHARS = 100_000
ARGV = [
    *("--arch", "llama", "--n-layer", "2", "--n-head", "4", "--n-embd", "32"),
    *("--ffn-hidden", "64", "--block-size", "16", "--n-experts", "4", "--top-k", "2"),
    *("--moe-bias-balance", "0.01", "--batch-size", "2", "--max-steps", "3", "--warmup", "1"),
    *("--eval-every", "0", "--peak-flops", "1e11", "--save-every", "1", "--device", "cpu"),
]


def args(corpus, out, *extra):
    return [*ARGV, "--corpus", str(corpus), "--data-cache", str(out.parent / "cache")] + [
        "--out-dir",
        str(out),
        *extra,
    ]


@pytest.fixture(scope="module")
def nan_run(corpus, tmp_path_factory, one_thread):
    """The run with its step 2 NaN; the routing biases as each step's statistics are taken (before
    that step's bias update): biases[k] is the bias after step k."""
    out = tmp_path_factory.mktemp("nan") / "out"
    biases, real = [], moe.step_stats

    def spy(model, grid):
        biases.append([m.expert_bias.clone() for m in moe.layers(model).values()])
        return real(model, grid)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "step_stats", spy)
        train.main(args(corpus, out, "--inject-fault", "nan:0:2"))
    final = checkpoint.load_shard(checkpoint.latest(out), 0)["moe_bias"]
    biases.append(list(final))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return out, biases, {r["step"]: r for r in rows if "skipped" in r}


def same(a, b):
    return all(x.eq(y).all() for x, y in zip(a, b))


def test_a_nan_skipped_step_leaves_the_routing_bias_bitwise(nan_run):
    _, biases, rows = nan_run
    assert [rows[s]["skipped"] for s in (1, 2, 3)] == [False, True, False]
    assert len(biases) == 4  # before step 1, after steps 1, 2 and 3
    assert not same(biases[0], biases[1]) and not same(biases[2], biases[3])  # moved when taken
    assert same(biases[1], biases[2])  # the skipped step 2: not moved, bitwise


def find(corpus, out, *extra):
    """The recipe's steps before any collective (train.train): the pure checks, then the
    checkpoint to resume."""
    config = checks.check(flags.parse(args(corpus, out, "--max-steps", "4", "--resume", *extra)))
    sha256 = data.tokenizer_sha256(data.get_tokenizer(config.tokenizer))
    return faults.find_checkpoint(
        config.out_dir,
        flags.model_config(config),
        resume=True,
        resume_from=None,
        max_steps=config.max_steps,
        recorded=saves.layout(config, sha256),
        allowed=faults.overrides(config),
    )


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--router", "softmax_topk"),
        ("--capacity-factor", "1.5"),
        ("--moe-aux-loss", "0.02"),
        ("--moe-z-loss", "0.001"),
        ("--moe-bias-balance", "0.001"),
        ("--document-mask", None),
    ],
)
def test_each_arithmetic_option_is_compared_on_resume(nan_run, corpus, flag, value):
    out = nan_run[0]
    change = [flag] if value is None else [flag, value]
    with pytest.raises(ValueError) as e:
        find(corpus, out, *change)
    assert f"trained with {flag} " in str(e.value) and "--allow-arithmetic-change" in str(e.value)
    assert "\n" not in str(e.value)
    assert find(corpus, out, *change, "--allow-arithmetic-change") == checkpoint.latest(out)


def test_a_resume_under_another_router_is_one_line_then_allowed(nan_run, corpus, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(nan_run[0], out, ignore=shutil.ignore_patterns(".lock"))
    before = sorted(p.name for p in (out / "ckpt").iterdir())
    resume = args(corpus, out, "--max-steps", "4", "--resume", "--router", "softmax_topk")
    p = subprocess.run(
        [sys.executable, "nanomega/train.py", *resume],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
    )
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-3000:]
    assert "trained with --router mixtral, not this --router softmax_topk" in p.stderr
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == before and p.stdout == ""

    rec = train.main([*resume, "--allow-arithmetic-change"])  # deliberate: accepted
    assert rec["step"] == 4
