"""Failures at scale, the job's half: what a month-long run meets around its steps (OPT-175B's and
BLOOM's logbooks).

Every failure must cost at most one checkpoint interval and never a silent loss: one job per out-dir
(claim_out_dir, lock.py); resume from the newest verified checkpoint, chosen before any collective
(find_checkpoint; under --flash-restore settle() puts each rank's own check to one vote); workers
die with their torchrun agent; preemption is agreed at a step boundary (grid_agrees); one-line
errors. The step's half (hangs, NaN, divergence, loss spikes, --inject-fault):
nanomega/ops/guard.py.

Formula: a job of N ranks, each failing with probability p per hour, survives an hour with (1-p)^N.
Lessons: lessons/10-checkpoints-and-failures.md, lessons/12-when-training-breaks.md
"""
import contextlib
import datetime
import ctypes
import errno
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as tdist

from nanomega import checkpoint, data, dist, flash
from nanomega.ops import lock

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def rank():
    return int(os.environ.get("RANK", 0))


def say(message):
    """One line on stderr from rank 0 only: the same line from every rank is noise."""
    if rank() == 0:
        print(message, file=sys.stderr, flush=True)


def check_out_dir(out_dir, flag="--out-dir"):
    """A folder flag (--out-dir, --data-cache) must be (or be creatable as) a directory: no regular
    file on its path."""
    path = os.path.abspath(out_dir)
    while path != os.path.dirname(path):
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {out_dir}: {path} is a file, not a directory; choose another {flag}")
        path = os.path.dirname(path)


def claim_out_dir(out_dir, data_cache=None):
    """A step of train.py's recipe, after the checks and before any collective: rank 0 takes
    OUT/.lock (one job per out-dir) and removes the `.tmp` files of a save that did not finish and
    the folders of a data preparation killed mid-way (in --data-cache, default OUT/data). Every rank
    may call it."""
    if rank() == 0:
        try:
            lock.lock_out_dir(out_dir)
        except OSError as e:
            # read-only, no permission, no space: the flag and the fix, not a bare OSError
            raise ValueError(f"--out-dir {out_dir}: cannot write there ({e.strerror}); choose a writable "
                             f"--out-dir") from None
        for path in clean_tmp(out_dir):
            say(f"resume: removed {path} (left by a save that did not finish)")
        for path in clean_prepare(data_cache or os.path.join(out_dir, "data")):
            say(f"removed {path} (left by a data preparation that was killed)")


def clean_tmp(out_dir):
    """Remove the `.tmp` files a crash left behind (only while this job holds the out-dir lock).
    Returns them."""
    found = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(out_dir, "ckpt")) for f in files
             if f.endswith(".tmp")]
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
    mine = re.compile(re.escape(data.TMP.format(name="@", host=socket.gethostname(), pid="@")).replace("@", "(.+?)"))
    gone = [os.path.join(folder, d) for d in os.listdir(folder)
            if (m := mine.match(d)) and m.group(2).isdigit() and not os.path.exists(f"/proc/{m.group(2)}")]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def find_checkpoint(out_dir, cfg, *, resume, resume_from, max_steps, tokenizer=None, allow_tokenizer_change=False,
                    fast=None):
    """The next step of the recipe: the checkpoint to resume from (or None), chosen
    before any collective.

    A checkpoint in out_dir without --resume is refused (nothing is overwritten); so is one at or
    past --max-steps (nothing to do is an error, not a silent no-op), and one trained with another
    tokenizer (tokenizer: (name, data.tokenizer_sha256) of --tokenizer; the same vocabulary size
    with other ids would resume silently into nonsense) unless allow_tokenizer_change. --resume-from
    STEP: rank 0 moves the newer checkpoints aside to OUT/ckpt/abandoned/ (kept, not deleted). fast:
    (flash.Copies, layout, world) under --flash-restore: when the newest complete folder passes
    every check a manifest allows (flash.look) and none of the refusals above, a flash.Found -- no
    shard file read -- for settle() to put to the grid's vote; otherwise (and with --resume-from)
    the full discovery, here."""
    folder = checkpoint.latest(out_dir)
    if folder and not resume:
        raise ValueError(f"--out-dir {out_dir} already holds a checkpoint ({folder}); "
                         f"pass --resume to continue it or choose another --out-dir")
    if not resume:
        return None
    if fast and folder:
        found, why = flash.look(out_dir, cfg, *fast) if resume_from is None else (None, "--resume-from")
        if found and not refusal(found.folder, found.manifest, max_steps, tokenizer, allow_tokenizer_change):
            found.full = lambda: find_checkpoint(out_dir, cfg, resume=True, resume_from=None, max_steps=max_steps,
                                                 tokenizer=tokenizer, allow_tokenizer_change=allow_tokenizer_change)
            return found
        if rank() == fast[2] - 1:  # the last rank, as train.py's log lines
            print(f"resume: full discovery (every shard verified on disk): {why or 'the newest one is refused'}",
                  flush=True)
    folder, skipped = checkpoint.find_resume(out_dir, cfg, resume_from)
    for reason in skipped:
        say(f"resume: skipped {reason}")
    if folder is None:
        return None
    manifest = checkpoint.read_manifest_json(folder)  # find_resume verified it
    problem = refusal(folder, manifest, max_steps, tokenizer, allow_tokenizer_change)
    if problem:
        raise ValueError(problem)
    if resume_from is not None and rank() == 0:
        for moved in checkpoint.set_aside_newer(out_dir, manifest["step"]):
            say(f"resume: moved {moved} (newer than step {manifest['step']}) to {out_dir}/ckpt/abandoned/")
    return folder


def refusal(folder, manifest, max_steps, tokenizer, allow_tokenizer_change):
    """Why the checkpoint found in `folder` may not be resumed (another tokenizer, nothing left to
    train), or None."""
    step, saved = manifest["step"], manifest["layout"].get("tokenizer_sha256")
    if tokenizer and saved and saved != tokenizer[1] and not allow_tokenizer_change:
        return (f"--resume: the checkpoint in {folder} was trained with --tokenizer "
                f"{manifest['layout'].get('tokenizer')}, not this --tokenizer {tokenizer[0]} (another "
                f"token table); pass that one, or --allow-tokenizer-change to fine-tune with this one")
    if step >= max_steps:
        return (f"--max-steps {max_steps} is at or below the checkpoint's step {step} ({folder}); "
                f"raise --max-steps to train on")
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
            print(f"resume: {name} verified by each rank from its shared-memory copy (" +
                  (f"{peers} rank(s) also read a peer's shard from storage)" if peers else
                   "no shard read from storage)"), flush=True)
        return found.folder
    if log:
        print(f"resume: full discovery (every shard verified on disk): {grid.world - verified} of {grid.world} "
              f"ranks could not verify their shard of {name} from shared memory", flush=True)
    return found.full()


def grid_votes(grid, *flags):
    """Each flag True on every rank if any rank says so: one all-reduce over the whole grid (per
    axis) and one host sync for all of them -- the step-boundary votes behind every decision all
    ranks must take alike. A flag may be a count still on the device
    (zero.ZeroEngine.nonfinite_masters): it is not read alone."""
    t = torch.stack([f.reshape(()).float().to(grid.device) if torch.is_tensor(f) else
                     torch.tensor(float(f), device=grid.device) for f in flags])
    # dp_cp: the cp ranks too (it is dp itself when cp = 1)
    for axis in (grid.tp, grid.pp, grid.dp_cp):
        axis.all_reduce(t)
    return tuple(v > 0 for v in t.tolist())


def grid_agrees(grid, flag):
    """grid_votes of one flag (save, stop, spike)."""
    return grid_votes(grid, flag)[0]


_PREEMPTED, _OLD_HANDLERS = [], {}  # _PREEMPTED: the monotonic time of the first signal
# One preemption arrives as several signals within moments: Slurm's scancel signals every process of
# the step, and torchrun's agent forwards its own to the workers. Within this grace they are one
# request (checkpoint at the next step boundary); a signal after it means "stop now" (torchrun
# itself SIGKILLs 30 s after forwarding).
PREEMPT_GRACE = 30.0


def _on_signal(signum, frame):
    # asked again, later: stop now
    if _PREEMPTED and time.monotonic() - _PREEMPTED[0] > PREEMPT_GRACE:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    if not _PREEMPTED:
        _PREEMPTED.append(time.monotonic())


def arm_preemption():
    """From the first training step on, SIGTERM/SIGUSR1 mean: checkpoint at the next step boundary.
    Not before: a Python handler cannot run while C++ blocks (a rendezvous), and the default action
    must end it."""
    if threading.current_thread() is threading.main_thread():
        for s in PREEMPT_SIGNALS:
            _OLD_HANDLERS.setdefault(s, signal.signal(s, _on_signal))


def preempt_requested():
    return bool(_PREEMPTED)


def saved(out_dir, keep_last, resumed_from, grid, step=None):
    """After the save of `step`: rank 0 applies --keep-last (never the folder this run resumed from,
    nor a folder past `step`: checkpoint.retain)."""
    if keep_last and grid.rank == 0:
        for folder in checkpoint.retain(out_dir, keep_last, protect=[resumed_from], upto=step):
            say(f"--keep-last {keep_last}: removed {folder}")


def die_with_parent():
    """Under torchrun, ask the kernel to SIGKILL this worker when its agent dies (no
    orphan trains on)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent or parent == 1:  # the agent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


_AT_JOB_END = []  # callables run when the job ends (the hang watchdogs' stop)


def at_job_end(stop):
    """Run stop() when the job (below) ends, however it ends."""
    _AT_JOB_END.append(stop)


@contextlib.contextmanager
def job(out_dir):
    """Around train.main: no orphans; afterwards what at_job_end registered stopped, the signal
    handlers restored and the out-dir lock released (kept by its holder when the job failed and
    torchrun restarts it: lock.py), and this rank's --flash-restore copy in shared memory removed
    (kept alike for the restart: flash.py)."""
    _PREEMPTED.clear()
    die_with_parent()
    ended = False
    try:
        yield
        ended = True
    finally:
        while _AT_JOB_END:
            _AT_JOB_END.pop()()
        for s in list(_OLD_HANDLERS):
            signal.signal(s, _OLD_HANDLERS.pop(s))
        restart = not ended and lock.restart_follows()
        lock.unlock_out_dir(out_dir, keep_for_restart=restart)
        # host RAM: a copy serves only a restart; a leftover of an earlier job of out_dir goes too
        if not restart:
            flash.drop(out_dir, rank())


def _peer_failure(e):
    """An error seen because ANOTHER rank died (a broken collective): that rank tells the story."""
    text = str(e).lower()
    return isinstance(e, tdist.DistError) or any(
        m in text for m in ("connection closed by peer", "connection reset", "broken pipe", "gloo"))


def entrypoint(main):
    """Run main as a script: an expected failure is one line (from rank 0 when every rank fails the
    same way, else from the rank that failed) and, under torchrun, recorded in the error file its
    summary shows."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler
    handler = get_error_handler()
    handler.initialize()
    try:
        main()
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        # the same on every rank: rank 0 says it
        handler.record_exception(e)
        say(f"error: {e}")
        sys.exit(2 if not isinstance(e, FloatingPointError) else 3)
    except (OSError, RuntimeError) as e:
        line = lost_ranks(e) if isinstance(e, RuntimeError) else None
        # a collective failed and ranks no longer answer: rank 0 names them, once
        if line is not None:
            if line:
                handler.record_exception(e)
                print(f"error: {line}", file=sys.stderr, flush=True)
            sys.exit(1)
        if _peer_failure(e):
            # quiet: the rank that failed first prints, and torchrun names it as the root cause
            sys.exit(1)
        handler.record_exception(e)
        # the same line from every rank it reaches
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            print(f"error: rank {rank()}: no space left on the device of {e.filename or 'the output'}: free space, "
                  f"lower --keep-last or choose another --out-dir / --data-cache; the newest complete checkpoint is "
                  f"untouched (--resume continues from it)", file=sys.stderr, flush=True)
            sys.exit(1)
        print(f"error: rank {rank()}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


COMM_ERRORS = ("gloo", "NCCL", "Timed out", "Connection", "timeout")


def lost_ranks(error, wait_s=5.0):
    """After a collective failed: which ranks still answer through the store within wait_s seconds?

    Returns None when `error` is not a communication error or nobody is missing (re-raise it), "" on
    every rank but 0, and on rank 0 one line naming the ranks (and their hosts) that did not answer.
    A rank whose host is cut off cannot reach the store either; it gives up after wait_s and stays
    silent: rank 0 names it.
    """
    if not tdist.is_initialized() or not any(k in str(error) for k in COMM_ERRORS):
        return None
    rank, world, kv = tdist.get_rank(), tdist.get_world_size(), dist.store()
    kv.set_timeout(datetime.timedelta(seconds=wait_s))
    try:
        kv.set(f"nanomega/alive/{rank}", "1")
    except Exception:  # cut off from the store as well: nothing more to learn here
        return ""
    # stay until rank 0 has spoken: its host's agent stops all its workers when one exits
    if rank != 0:
        try:
            kv.wait(["nanomega/verdict"], datetime.timedelta(seconds=3 * wait_s))
        except Exception:
            pass
        return ""
    deadline = time.monotonic() + wait_s
    missing = list(range(world))
    while missing and time.monotonic() < deadline:  # bounded: wait_s seconds, polled every 0.1 s
        missing = [r for r in missing if not kv.check([f"nanomega/alive/{r}"])]
        time.sleep(0.1)
    kv.set("nanomega/verdict", str(missing))
    if not missing:  # every rank answers: not a lost host; the traceback says more than a line
        return None
    first = str(error).strip().splitlines()[0][:160]
    hosts = sorted({kv.get(f"nanomega/host/{r}").decode() for r in missing if kv.check([f"nanomega/host/{r}"])})
    return (f"rank(s) {', '.join(map(str, missing))} on {', '.join(hosts) or 'unknown hosts'} unreachable: a "
            f"collective failed ({first}) and they did not answer through the store within {wait_s:.0f} s; "
            f"the job stops here and resumes from its last checkpoint when restarted (torchrun --max-restarts)")
