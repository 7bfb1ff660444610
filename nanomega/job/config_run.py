"""The run's flags: numerics, recompute and kernels; what it prints; its checkpoints; what it does when
a step or a rank goes wrong; the dry run. One field per flag (job/section.py).
Lesson: lessons/20-when-training-breaks.md
"""

import argparse
import dataclasses
import os

from nanomega.job.ranges import MAX_TIMEOUT, MAX_WORLD, above, at_least, within
from nanomega.job.section import CHECKPOINTS, DRY_RUN, FAILURES, LOGGING, PRECISION


@dataclasses.dataclass(frozen=True)
class RunFlags:
    """Precision and kernels, logging, checkpoints, failures, the dry run."""

    # numerics, recompute, kernels and the device
    dtype: str = PRECISION("fp32", "fp32, bf16 or fp16 (with dynamic loss scaling)")
    recompute: str = PRECISION("none", "none, selective or full")
    recompute_layers: int | None = PRECISION(
        None, "recompute only the first k layers"
    )  # its range needs --n-layer: checks.check
    fused: bool = PRECISION(False, "C++/CUDA fused LayerNorm, softmax, bias-GeLU")
    attention: str = PRECISION(
        "sdpa",
        "sdpa (F.scaled_dot_product_attention: FlashAttention on CUDA), eager (explicit softmax, "
        "as the lessons teach) or fused (eager + our fused softmax)",
        model=True,
    )
    device: str = PRECISION(
        lambda: os.environ.get("NANOMEGA_DEVICE", "auto"),
        "auto: CUDA when present ($NANOMEGA_DEVICE changes this default: the CPU test suite's is cpu)",
        choices=["auto", "cpu", "cuda"],
    )
    tf32: bool = PRECISION(
        True,
        "fp32 matmuls in TF32 on CUDA tensor cores (--no-tf32: full fp32)",
        action=argparse.BooleanOptionalAction,
    )
    compile: bool = PRECISION(False, "torch.compile each transformer block")
    fp8: str = PRECISION(
        "off",
        "the blocks' linears in FP8 (nanomega/fp8_linear.py): tensorwise, delayed, rowwise, "
        "blockwise (DeepSeek-V3) or mxfp8; the head and the MoE router stay in --dtype",
        choices=["off", "tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"],
    )
    fp8_block: int = PRECISION(
        128, "--fp8 blockwise: the tile side (DeepSeek-V3: 128)", at_least(1)
    )
    fp8_history: int = PRECISION(
        1024, "--fp8 delayed: amax history length (Transformer Engine's default)", at_least(1)
    )
    fp8_min_dim: int = PRECISION(
        0,
        "--fp8: a weight with a dimension below this stays in --dtype. Default 0 (all in FP8): this "
        "CPU has no FP8 units, so no size pays; on an H100 torchao keeps e.g. tensorwise GEMMs with "
        "K <= 4096 and N <= 1024 in bf16 (its auto-filter)",
        at_least(0),
    )

    # what the run prints and measures
    out_dir: str = LOGGING("out", "checkpoints, metrics.jsonl, traces (one job at a time)")
    log_every: int = LOGGING(10, "print a line every N steps", at_least(1))
    tensorboard: str | None = LOGGING(
        None, "also write metrics.jsonl's scalars as TensorBoard events to DIR (the extra)"
    )
    eval_every: int = LOGGING(100, "validation loss every N steps (0: never)", at_least(0))
    eval_iters: int = LOGGING(10, "global batches per validation", at_least(1))
    peak_flops: float | None = LOGGING(
        None,
        "peak FLOP/s per device for MFU (default: the datasheet of a known GPU, else measured)",
        above(0, " FLOP/s per device"),
    )

    # when to save, how many to keep, where to resume from
    save_every: int = CHECKPOINTS(0, "checkpoint every N steps (0: only at the end)", at_least(0))
    save_every_minutes: float = CHECKPOINTS(0.0, "also checkpoint every M minutes", at_least(0))
    async_save: bool = CHECKPOINTS(False, "write checkpoints from a background thread")
    flash_restore: bool = CHECKPOINTS(
        False,
        "also keep each rank's newest shard in /dev/shm (host RAM: one shard per rank, two while "
        "a save is in flight); a restart on the same host reads it from there when step and "
        "sha256 match (nanomega/flash.py); removed at the job's end",
    )
    keep_last: int = CHECKPOINTS(
        0,
        "keep only the K newest checkpoints (0: keep all); the one resumed from is never deleted",
        at_least(0),
    )
    resume: bool = CHECKPOINTS(
        False, "continue from the last checkpoint in --out-dir; start fresh if none"
    )
    resume_from: str | None = CHECKPOINTS(
        None,
        "resume from this step (OUT/ckpt/step_STEP) or checkpoint folder; implies --resume",
        metavar="STEP|PATH",
    )
    allow_tokenizer_change: bool = CHECKPOINTS(
        False,
        "resume a checkpoint trained with another --tokenizer (refused otherwise: its token ids "
        "would mean other text)",
    )
    allow_arithmetic_change: bool = CHECKPOINTS(
        False,
        "resume a checkpoint trained with another --router, --capacity-factor, --moe-aux-loss, "
        "--moe-z-loss, --moe-bias-balance or --document-mask (refused otherwise: every step would "
        "compute otherwise; job/faults.py ARITHMETIC)",
    )

    # what the run does when a step or a rank goes wrong (lesson 20)
    on_nan: str = FAILURES(
        "skip", "skip (drop the step) or stop, when the loss or grad norm is not finite"
    )
    max_skipped: int = FAILURES(
        20,
        "stop (non-zero) after this many consecutive skipped (non-finite) steps",
        at_least(0),
    )
    on_spike: str = FAILURES(
        "warn",
        "a loss above --spike-threshold x its running mean: log it, drop that step's update, or "
        "reload the last verified checkpoint and skip the data since it",
        choices=["warn", "skip", "rollback"],
    )
    spike_threshold: float = FAILURES(
        1.5,
        "a spike: loss > this x its running mean",
        above(1, " (a spike: loss > this x its running mean)"),
    )
    rollback_lr_factor: float = FAILURES(
        1.0,
        "scale the lr by this at each rollback",
        (lambda v, c: 0 < v <= 1, "in (0, 1]"),
    )
    collective_timeout: float = FAILURES(
        300.0,
        "seconds before a stuck collective aborts the job",
        (
            lambda v, c: 0 < v <= MAX_TIMEOUT,
            f"> 0 and <= {MAX_TIMEOUT} seconds (30 days)",
        ),
    )
    hang_timeout: float | None = FAILURES(
        None,
        "seconds without progress before every live rank dumps its stacks to OUT/hang/ and the "
        "job names the stuck ranks and exits (0: off; default: 180, or half "
        "--collective-timeout if that is less)",
        (
            lambda v, c: 0 <= v < c.collective_timeout,
            (
                ">= 0 (0: off) and below --collective-timeout {c.collective_timeout:g} (the "
                "watchdog must fire before the collective gives up)"
            ),
        ),
    )
    health_check: bool = FAILURES(
        False,
        "check every rank's compute and links first (nanomega/job/health.py); a bad rank stops "
        "the job with one line",
    )
    inject_fault: str | None = FAILURES(
        None,
        "testing fault handling: KIND raise (the rank raises), nan (its loss becomes NaN), sigterm "
        "(it is sent SIGTERM, a preemption) hang (it stops itself, SIGSTOP), hang-save (it stops "
        "while writing STEP's checkpoint) or spike (its loss x 10) at STEP",
        metavar="KIND:RANK:STEP",
    )

    # one rank of the layout on the meta device, then exit
    dry_run: bool = DRY_RUN(
        False,
        "build one rank of this layout on the meta device (no process group, nothing allocated), "
        "print its parameter, gradient and optimizer bytes next to the planner's, and exit; with "
        "--model the vocabulary is the preset's (no data is read)",
    )
    rank: int = DRY_RUN(0, "the rank --dry-run builds", at_least(0))
    world: int | None = DRY_RUN(
        None, "the world size --dry-run assumes (default: tp x pp)", within(1, MAX_WORLD)
    )
