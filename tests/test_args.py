"""Bad configurations are refused on every rank before any collective: one clear line each, < 10 s;
each flag is declared once (job/config.py:Config); the parser and the range table come from that
(job/flags.py)."""

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanomega.gpt_config import GPTConfig
from nanomega.job import checks, flags
from nanomega.job.config import Config

ROOT = Path(__file__).resolve().parent.parent

# (world size, flags, what the message must say)
BAD = [
    (4, ["--tp", "3"], "world size 4 is not divisible by --tp 3 x --pp 1"),
    (4, ["--tp", "4", "--n-head", "6", "--n-embd", "96"], "--tp 4 does not divide --n-head 6"),
    (1, ["--save-every", "-1"], "--save-every must be >= 0"),
    (4, ["--pp", "4", "--n-layer", "2"], "--pp 4 is larger than --n-layer 2"),
    (2, ["--pp", "2", "--zero", "2"], "--zero 2 with --pp 2"),
    (1, ["--zero", "5"], "--zero 5"),
    (2, ["--pp", "2", "--microbatches", "0"], "--grad-accum must be >= 1"),
    (
        4,
        [
            "--pp",
            "2",
            "--schedule",
            "interleaved",
            "--virtual-stages",
            "2",
            "--n-layer",
            "6",
            "--grad-accum",
            "4",
        ],
        "--n-layer 6 is not divisible by --pp 2 x --virtual-stages 2",
    ),
    (2, ["--pp", "2", "--schedule", "zigzag"], "--schedule 'zigzag' is unknown"),
    (2, ["--pp", "2", "--schedule", "zb-h1", "--compile"], "defers weight gradients at run time"),
    (2, ["--pp", "2", "--schedule", "zb-h1", "--virtual-stages", "2"], "needs --schedule inter"),
    (
        2,
        ["--pp", "2", "--schedule", "zb-v"],
        "needs --pp >= 2 and --virtual-stages 2, got pp 2, vi",
    ),
    (
        2,
        ["--tp", "2", "--sequence-parallel", "--block-size", "33"],
        "--block-size 33 divisible by --tp 2",
    ),
    (1, ["--dtype", "fp8"], "--dtype 'fp8'"),
    (1, ["--recompute", "some"], "--recompute 'some'"),
    (1, ["--recompute", "full", "--recompute-layers", "9"], "--recompute-layers 9"),
    (1, ["--corpus", "/no/such/file.txt"], "--corpus /no/such/file.txt does not exist"),
    (1, ["--tokenizer", "gpt5"], "--tokenizer"),
    (1, ["--n-embd", "100", "--n-head", "3"], "--n-embd 100 is not divisible by --n-head 3"),
    (1, ["--lr", "0"], "--lr must be > 0"),
    (1, ["--on-nan", "ignore"], "--on-nan 'ignore'"),
    (1, ["--inject-fault", "boom"], "--inject-fault 'boom'"),
    (1, ["--device", "cuda"], "--device cuda"),
    (1, ["--model", "gpt5"], "--model 'gpt5' is unknown"),
    (1, ["--arch", "mamba"], "--arch 'mamba' is not one of gpt2, llama"),
    (
        1,
        ["--arch", "llama", "--n-kv-head", "3"],
        "--n-kv-head 3 does not divide --n-head 4; choose among 1, 2, 4",
    ),
    (
        1,
        ["--n-kv-head", "2"],
        "--n-kv-head, --ffn-hidden and --untie-embeddings are for --arch llama",
    ),
    (1, ["--arch", "llama", "--alibi"], "--alibi and --embed-layernorm are BLOOM's"),
    (1, ["--offload", "1"], "--offload needs --zero 1, 2 or 3"),
    # issue 43: named as itself, not as --offload
    (1, ["--offload-params"], "--offload-params needs --zero 3 and --offload 1 (got --zero 0"),
    (
        4,
        [
            "--model",
            "llama-small",
            "--tp",
            "4",
            "--n-kv-head",
            "3",
            "--n-head",
            "12",
            "--n-embd",
            "96",
        ],
        "--tp 4 and --n-kv-head 3: one must divide the other",
    ),
]

# issue 28: every numeric flag finite and in range (nanomega/job/ranges.py); inf and NaN passed the
# old checks (`lr > 0`, `weight_decay < 0`) and made every weight non-finite, or overflowed
# timedelta / the seed
NUMBERS = [
    (["--lr", "inf"], "--lr must be > 0, got inf (not a finite number); the default is 0.001"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--min-lr", "nan"], "--min-lr must be in [0, --lr 0.001]"),
    (["--weight-decay", "nan"], "--weight-decay must be >= 0, got nan"),
    (["--weight-decay", "inf"], "--weight-decay must be >= 0, got inf"),
    (["--grad-clip", "nan"], "--grad-clip must be >= 0, got nan"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--dropout", "nan"], "--dropout must be in [0, 1), got nan"),
    (["--collective-timeout", "inf"], "--collective-timeout must be > 0 and <= 2592000 seconds"),
    (["--collective-timeout", "1e14"], "--collective-timeout must be > 0 and <= 2592000 seconds"),
    (
        ["--hang-timeout", "nan"],
        "--hang-timeout must be >= 0 (0: off) and below --collective-timeout 300",
    ),
    (
        ["--hang-timeout", "400"],
        "--hang-timeout must be >= 0 (0: off) and below --collective-timeout 300",
    ),
    (["--save-every-minutes", "nan"], "--save-every-minutes must be >= 0, got nan"),
    (["--peak-flops", "-1"], "--peak-flops must be > 0 FLOP/s per device, got -1.0; leave it out"),
    (["--peak-flops", "inf"], "--peak-flops must be > 0 FLOP/s per device, got inf"),
    (["--spike-threshold", "nan"], "--spike-threshold must be > 1"),
    (["--rollback-lr-factor", "nan"], "--rollback-lr-factor must be in (0, 1]"),
    (["--seed", "-1"], "--seed must be in [0, 2**62), got -1"),
    (["--seed", str(2**64)], "--seed must be in [0, 2**62)"),
    (["--arch", "llama", "--rope-theta", "0"], "--rope-theta must be > 0"),
    (
        ["--arch", "llama", "--rope-scaling", "nan"],
        "--rope-scaling must be > 0 (1: no scaling), got nan",
    ),
    (["--norm-eps=-1e-5"], "--norm-eps must be > 0"),
    (["--norm-eps", "inf"], "--norm-eps must be > 0, got inf"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--offload", "nan"], "--offload must be in [0, 1]"),
    (["--zero", "1", "--offload", "1.5"], "--offload must be in [0, 1]"),
    # issue 43: it took 59 s and ended out of memory, not naming --world
    (["--dry-run", "--world", "100000000"], "--world must be in [1, 1,048,576]"),
]


@pytest.mark.parametrize("argv,message", NUMBERS, ids=[" ".join(b[0]) for b in NUMBERS])
def test_numeric_flags_finite_and_in_range(argv, message, monkeypatch, tmp_path):
    """One line naming the flag, the value and the fix, before any collective, and nothing
    written."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError) as err:
        checks.check(flags.parse([*argv, "--out-dir", str(tmp_path / "out")]))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())


def test_warmup_longer_than_the_run_is_allowed():
    """A decision (issue 28, item 7): the run only warms up; quick runs override --max-steps
    alone."""
    assert (
        checks.check(
            flags.parse(["--warmup", "50", "--max-steps", "3", "--out-dir", "/nonexistent/o"])
        ).warmup
        == 50
    )


@pytest.mark.parametrize("world,argv,message", BAD, ids=[" ".join(b[1]) for b in BAD])
def test_bad_configuration(world, argv, message, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    t0 = time.perf_counter()
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        checks.check(flags.parse([*argv, "--out-dir", str(tmp_path)]))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert time.perf_counter() - t0 < 10


def test_cli_reports_layout_error_in_one_line_without_starting(tmp_path):
    """Under torchrun's environment (WORLD_SIZE=4) the check runs before the rendezvous: no store is
    needed."""
    env = {
        "WORLD_SIZE": "4",
        "RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
        "PATH": "/usr/bin",
    }
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "nanomega/train.py", "--tp", "3", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: world size 4 is not divisible by --tp 3 x --pp 1; launch a multiple of 3 processes"
    ]
    assert time.perf_counter() - t0 < 10 and not any(tmp_path.iterdir())


def test_cli_refuses_an_infinite_timeout_in_one_line(tmp_path):
    """--collective-timeout inf / 1e14 was an OverflowError traceback from timedelta on every
    rank."""
    env = {
        "WORLD_SIZE": "2",
        "RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
        "PATH": "/usr/bin",
    }
    out = subprocess.run(
        [
            sys.executable,
            "nanomega/train.py",
            "--collective-timeout",
            "1e14",
            "--out-dir",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: --collective-timeout must be > 0 and <= 2592000 seconds (30 days), got 100000000000000.0; "
        "the default is 300"
    ]
    assert not any(tmp_path.iterdir())


def test_model_preset_sets_the_shape_and_explicit_flags_override():
    from nanomega.job.presets import PRESETS

    a = flags.parse(["--model", "gpt2-124m"])
    assert (a.n_layer, a.n_head, a.n_embd, a.block_size, a.alibi) == (12, 12, 768, 1024, False)
    a = flags.parse(
        ["--model", "bloom-176b", "--n-layer", "2", "--n-embd=112", "--block-size", "64"]
    )
    # heads from the preset
    assert (a.n_layer, a.n_head, a.n_embd, a.block_size) == (2, 112, 112, 64)
    assert a.alibi and a.embed_layernorm
    cfg = flags.model_config(flags.parse(["--model", "gpt2-350m"]), vocab_size=4096)
    # the tokenizer's vocabulary
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size) == (24, 16, 1024, 4096)
    assert {"gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "bloom-176b", "gpt3-175b"} <= set(
        PRESETS
    )


def test_the_cpu_suite_runs_on_the_cpu_on_a_gpu_host(monkeypatch):
    """Issue 27 item 4: no test passed --device, so on a GPU host `auto` picked CUDA and every
    two-rank job of the CPU suite failed on a one-GPU machine ("LOCAL_RANK 1 but this node sees 1
    CUDA device"). conftest sets $NANOMEGA_DEVICE=cpu, train.py's default device. Here CUDA is made
    to look present."""
    from nanomega import dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert (
        flags.parse([]).device == "cpu"
        and dist.default_device(flags.parse([]).device).type == "cpu"
    )
    # what `--device auto` gives a user on that host
    assert dist.default_device("auto").type == "cuda"
    monkeypatch.delenv("NANOMEGA_DEVICE")
    assert flags.parse([]).device == "auto"  # outside the suite: the default is unchanged


DERIVED = {"dp", "vocab_size", "fault", "eot"}  # filled in by checks.check, not flags
# numeric flags whose range needs other flags (checks.check, pp.check_args, zero_rules.check_config)
CHECKED_BY_CONCEPT = {"global_batch", "virtual_stages", "zero", "recompute_layers"}


def coverage(config_type, parser):
    """(fields without a flag, flags without a field, fields set by two flags) in parser."""
    dests = [a.dest for a in parser._actions if a.dest != "help"]
    fields = {f.name for f in dataclasses.fields(config_type)} - DERIVED
    return fields - set(dests), set(dests) - fields, {d for d in dests if dests.count(d) > 1}


def test_every_flag_declared_once_and_the_parser_generated_from_it():
    """One home per flag: each Config field is exactly one flag, in its section's group of --help;
    the range table names only flags, and a numeric flag without a range is one its concept checks;
    model_config takes exactly GPTConfig's shape (less the vocabulary and its padding, which the
    tokenizer and --tp decide)."""
    p = flags.parser()
    assert coverage(Config, p) == (set(), set(), set())
    groups = {a.dest: g.title for g in p._action_groups for a in g._group_actions}
    assert all(groups[f.name] == f.metadata["section"] for f in flags.FLAGS)
    assert len({f.metadata["section"] for f in flags.FLAGS}) == 10

    numeric = {f.name for f in flags.FLAGS if f.type in (int, float, int | None, float | None)}
    assert set(flags.RANGES) <= numeric and numeric - set(flags.RANGES) == CHECKED_BY_CONCEPT
    shape = {f.name for f in flags.FLAGS if f.metadata["model"]}
    decided_elsewhere = {"vocab_size", "make_vocab_size_divisible_by"}
    assert shape == {f.name for f in dataclasses.fields(GPTConfig)} - decided_elsewhere

    # the check can fail: a field no flag sets, a flag no field holds, a field set by two flags
    fields = [("lonely", int, 0)]
    bad = dataclasses.make_dataclass("Bad", fields, bases=(Config,), frozen=True)
    p.add_argument("--stray", type=int)
    p.add_argument("--tensor-parallel", dest="tp", type=int)
    assert coverage(bad, p) == ({"lonely"}, {"stray"}, {"tp"})


def test_a_declared_range_is_checked(monkeypatch):
    """The range beside a flag is the one checks.check applies (the table is read, not copied)."""
    monkeypatch.setitem(flags.RANGES, "tp", (lambda v, c: v >= 5, ">= 5"))
    with pytest.raises(ValueError, match="--tp must be >= 5, got 1; the default is 1"):
        checks.check(flags.parse(["--out-dir", "/nonexistent/o"]))
