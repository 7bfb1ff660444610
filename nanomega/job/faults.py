"""Failures at scale, the out-dir's half: one job per out-dir and the checkpoint to resume from
(OPT-175B's and BLOOM's logbooks).

Every failure must cost at most one checkpoint interval and never a silent loss: one job per out-dir
(claim_out_dir, lock.py); resume from the newest verified checkpoint, chosen before any collective
(find_checkpoint; under --flash-restore settle() puts each rank's own check to one vote). The job's
life (workers die with their agent, preemption agreed at a step boundary, one-line errors):
job/lifecycle.py; the step's half (hangs, NaN, divergence, spikes, --inject-fault): job/guard.py.

Formula: a job of N ranks, each failing with probability p per hour, survives an hour with (1-p)^N.
Lessons: lessons/19-checkpoints-and-failures.md, lessons/20-when-training-breaks.md
"""

import os
import re
import shutil
import socket
import sys

from nanomega import checkpoint, data, flash, moe
from nanomega.job import lock


def rank():
    return int(os.environ.get("RANK", 0))


def say(message):
    """One line on stderr from rank 0 only: the same line from every rank is noise."""
    if rank() == 0:
        print(message, file=sys.stderr, flush=True)


# The options that change a step's arithmetic beyond the model's shape (checkpoint.read_manifest
# compares gpt_config.SHAPE_KEYS): what a checkpoint records of them (saves.layout) and a resume
# compares; the routing ones only with experts
ROUTING = ("router", "capacity_factor", "moe_aux_loss", "moe_z_loss", "moe_bias_balance")
ROUTING += ("n_group", "topk_group", "routed_scaling")
ARITHMETIC = ROUTING + ("document_mask",)
# what a resume compares with the checkpoint's layout: (key, the value shown: its flag's name, why
# it matters, the flag that allows a deliberate change)
RESUME_CHECKS = (
    ("tokenizer_sha256", "tokenizer", "another token table", "--allow-tokenizer-change"),
    *((k, k, "every step computes otherwise", "--allow-arithmetic-change") for k in ARITHMETIC),
)


def arithmetic(config):
    """{option: value} of this job's ARITHMETIC options (saves.layout records them)."""
    return {k: getattr(config, k) for k in ARITHMETIC if config.n_experts or k not in ROUTING}


def overrides(config):
    """The override flags of RESUME_CHECKS this job passes (--allow-tokenizer-change, ...)."""
    flags = {row[-1] for row in RESUME_CHECKS}
    return {f for f in flags if getattr(config, f[2:].replace("-", "_"))}


def check_out_dir(out_dir, flag="--out-dir"):
    """A folder flag (--out-dir, --data-cache) must be (or be creatable as) a directory: no regular
    file on its path."""
    path = os.path.abspath(out_dir)
    while path != os.path.dirname(path):
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(
                f"{flag} {out_dir}: {path} is a file, not a directory; choose another {flag}"
            )
        path = os.path.dirname(path)


def claim_out_dir(out_dir, data_cache=None):
    """A step of train.py's recipe, after the checks and before any collective: rank 0 takes
    OUT/.lock (one job per out-dir) and removes the `.tmp` files of a save that did not finish and
    the folders of a data preparation killed mid-way (in --data-cache, default OUT/data). Every rank
    may call it. An out-dir it creates is remembered: a job that fails before writing anything of
    its own there leaves nothing (forget_out_dir)."""
    if rank() == 0:
        new = not os.path.exists(out_dir)
        try:
            lock.lock_out_dir(out_dir)
        except OSError as e:
            # read-only, no permission, no space: the flag and the fix, not a bare OSError
            raise ValueError(
                f"--out-dir {out_dir}: cannot write there ({e.strerror}); choose a writable "
                f"--out-dir"
            ) from None
        if new:  # (created by the lock just taken)
            _CREATED.add(os.path.realpath(out_dir))
        for path in clean_tmp(out_dir):
            say(f"resume: removed {path} (left by a save that did not finish)")
        for path in clean_prepare(data_cache or os.path.join(out_dir, "data")):
            say(f"removed {path} (left by a data preparation that was killed)")


_CREATED = set()  # the out-dirs claim_out_dir created (realpath)


def forget_out_dir(out_dir):
    """After a failed job, its lock released: rank 0 removes an out-dir this job created when it
    holds nothing but the lock and the data cache (a corpus or data refusal: nothing is left
    behind, not even OUT/.lock). Returns whether it did."""
    key = os.path.realpath(out_dir)
    if key not in _CREATED:
        return False
    _CREATED.discard(key)
    if not os.path.isdir(out_dir) or not set(os.listdir(out_dir)) <= {".lock", "data"}:
        return False  # a checkpoint, metrics, hang dumps: the job's own, kept
    shutil.rmtree(out_dir, ignore_errors=True)
    return True


def clean_tmp(out_dir):
    """Remove the `.tmp` files a crash left behind (only while this job holds the out-dir lock).
    Returns them."""
    found = [
        os.path.join(d, f)
        for d, _, files in os.walk(os.path.join(out_dir, "ckpt"))
        for f in files
        if f.endswith(".tmp")
    ]
    for path in found:
        os.remove(path)
    return found


def clean_prepare(folder):
    """Remove the temporary folders (data.TMP) that a data preparation on this host left in `folder`
    when it was killed: their process is gone (no /proc/PID). Another rank's or job's, still
    preparing, stays. Returns them."""
    # no /proc (not Linux): remove none
    if not os.path.isdir(folder) or not os.path.isdir("/proc/self"):
        return []

    mine = re.compile(
        re.escape(data.TMP.format(name="@", host=socket.gethostname(), pid="@")).replace(
            "@", "(.+?)"
        )
    )
    gone = [
        os.path.join(folder, d)
        for d in os.listdir(folder)
        if (m := mine.match(d))
        and m.group(2).isdigit()
        and not os.path.exists(f"/proc/{m.group(2)}")
    ]

    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def find_checkpoint(
    out_dir,
    cfg,
    *,
    resume,
    resume_from,
    max_steps,
    recorded=None,
    allowed=(),
    fast=None,
):
    """The next step of the recipe: the checkpoint to resume from (or None), chosen
    before any collective.

    A checkpoint in out_dir without --resume is refused (nothing is overwritten); so is one at or
    past --max-steps (nothing to do is an error, not a silent no-op), and one trained with another
    tokenizer or other options of a step's arithmetic (RESUME_CHECKS: the checkpoint's layout
    against `recorded`, this job's saves.layout) unless the override flag is in `allowed`
    (overrides(config)). --resume-from
    STEP: rank 0 moves the newer checkpoints aside to OUT/ckpt/abandoned/ (kept, not deleted). fast:
    (flash.Copies, layout, world) under --flash-restore: when the newest complete folder passes
    every check a manifest allows (flash.look) and none of the refusals above, a flash.Found -- no
    shard file read -- for settle() to put to the grid's vote; otherwise (and with --resume-from)
    the full discovery, here."""
    folder = checkpoint.latest(out_dir)
    if folder and not resume:
        raise ValueError(
            f"--out-dir {out_dir} already holds a checkpoint ({folder}); "
            f"pass --resume to continue it or choose another --out-dir"
        )
    if not resume:
        return None
    if fast and folder:
        found, why = (
            flash.look(out_dir, cfg, *fast) if resume_from is None else (None, "--resume-from")
        )
        if found and not refusal(found.folder, found.manifest, max_steps, recorded, allowed):
            found.full = lambda: find_checkpoint(
                out_dir,
                cfg,
                resume=True,
                resume_from=None,
                max_steps=max_steps,
                recorded=recorded,
                allowed=allowed,
            )
            return found
        if rank() == fast[2] - 1:  # the last rank, as train.py's log lines
            print(
                f"resume: full discovery (every shard verified on disk): {why or 'the newest one is refused'}",
                flush=True,
            )
    folder, skipped = checkpoint.find_resume(out_dir, cfg, resume_from)
    for reason in skipped:
        say(f"resume: skipped {reason}")
    if folder is None:
        return None
    manifest = checkpoint.read_manifest_json(folder)  # find_resume verified it
    problem = refusal(folder, manifest, max_steps, recorded, allowed)
    if problem:
        raise ValueError(problem)
    if resume_from is not None and rank() == 0:
        for moved in checkpoint.set_aside_newer(out_dir, manifest["step"]):
            say(
                f"resume: moved {moved} (newer than step {manifest['step']}) to {out_dir}/ckpt/abandoned/"
            )
    return folder


def refusal(folder, manifest, max_steps, recorded=None, allowed=()):
    """Why the checkpoint found in `folder` may not be resumed (another tokenizer or other
    arithmetic than `recorded` says, RESUME_CHECKS; nothing left to train), or None. A key either
    side lacks (a checkpoint older than it, a dense model's routing) is not compared."""
    step, saved, now = manifest["step"], manifest["layout"], recorded or {}
    if "router" in saved:  # an old name is the rule it computed (moe.RENAMED)
        saved = {**saved, "router": moe.rule(saved["router"])}
    for key, shown, why, override in RESUME_CHECKS:
        if key in saved and key in now and saved[key] != now[key] and override not in allowed:
            flag = "--" + shown.replace("_", "-")
            return (
                f"--resume: the checkpoint in {folder} was trained with {flag} {saved.get(shown)}, "
                f"not this {flag} {now.get(shown)} ({why}); pass that one, or {override} to "
                f"change it deliberately"
            )
    if step >= max_steps:
        return (
            f"--max-steps {max_steps} is at or below the checkpoint's step {step} ({folder}); "
            f"raise --max-steps to train on"
        )
    return None


def settle(found, cfg, grid, engine, log):
    """After the grid exists, on every rank: the folder to resume from. A flash.Found goes to one
    vote over the grid (flash.agree): every rank verified its own shard from its copy -> that
    folder, each rank loading its copy; any rank short -> every rank runs the full discovery.
    Anything else is find_checkpoint's answer."""
    if not isinstance(found, flash.Found):
        return found

    verified, peers = flash.agree(found, cfg, grid, engine)
    name = os.path.basename(found.folder)
    if verified == grid.world:
        for reason in found.skipped:
            say(f"resume: skipped {reason}")
        if log:
            print(
                f"resume: {name} verified by each rank from its shared-memory copy ("
                + (
                    f"{peers} rank(s) also read a peer's shard from storage)"
                    if peers
                    else "no shard read from storage)"
                ),
                flush=True,
            )
        return found.folder

    # some rank short: every rank runs the full discovery
    if log:
        print(
            f"resume: full discovery (every shard verified on disk): {grid.world - verified} of {grid.world} "
            f"ranks could not verify their shard of {name} from shared memory",
            flush=True,
        )
    return found.full()


def saved(out_dir, keep_last, resumed_from, grid, step=None):
    """After the save of `step`: rank 0 applies --keep-last (never the folder this run resumed from,
    nor a folder past `step`: checkpoint.retain)."""
    if keep_last and grid.rank == 0:
        for folder in checkpoint.retain(out_dir, keep_last, protect=[resumed_from], upto=step):
            say(f"--keep-last {keep_last}: removed {folder}")
