"""The job's life around its steps: signals, votes, orphans and how it ends.

Idea: at scale a rank is preempted, orphaned or cut off routinely; each ends the job cleanly, once:
    preemption  SIGTERM/SIGUSR1 set a flag; all ranks agree at the next step boundary (grid_votes,
                one all-reduce), checkpoint and exit 0 (Slurm sends SIGUSR1 before the end)
    orphans     a worker asks the kernel for SIGKILL when its torchrun agent dies (PDEATHSIG)
    job         around train.main: watchdogs stopped, handlers restored, the out-dir lock released
    errors      one line per expected failure (entrypoint); lost hosts named via the store
Where a job starts from (the out-dir, the checkpoint to resume) is job/faults.py.
Lesson: lessons/19-checkpoints-and-failures.md
"""

import contextlib
import ctypes
import datetime
import errno
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as tdist

from nanomega import dist, flash
from nanomega.job import faults, lock
from nanomega.job.faults import rank, say

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def grid_votes(grid, *flags):
    """Each flag True on every rank if any rank says so: one all-reduce over the whole grid (per
    axis) and one host sync for all of them -- the step-boundary votes behind every decision all
    ranks must take alike. A flag may be a count still on the device
    (zero.ZeroEngine.nonfinite_masters): it is not read alone."""
    t = torch.stack(
        [
            f.reshape(()).float().to(grid.device)
            if torch.is_tensor(f)
            else torch.tensor(float(f), device=grid.device)
            for f in flags
        ]
    )
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


def die_with_parent():
    """Under torchrun, ask the kernel to SIGKILL this worker when its agent dies (no orphan trains
    on)."""
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
        if not ended and not restart:  # refused before writing: no out-dir left behind
            faults.forget_out_dir(out_dir)
        # host RAM: a copy serves only a restart; a leftover of an earlier job of out_dir goes too
        if not restart:
            flash.drop(out_dir, rank())


def _peer_failure(e):
    """An error seen because ANOTHER rank died (a broken collective): that rank tells the story."""
    text = str(e).lower()
    return isinstance(e, tdist.DistError) or any(
        m in text for m in ("connection closed by peer", "connection reset", "broken pipe", "gloo")
    )


def entrypoint(main):
    """Run main as a script: an expected failure is one line (from rank 0 when every rank fails the
    same way, else from the rank that failed) and, under torchrun, recorded in the error file its
    summary shows."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    handler = get_error_handler()
    handler.initialize()
    try:
        main()
    # the same on every rank: rank 0 says it
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
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
        # a full disk reaches every rank that writes: the first to report it says it, once
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            if not first_to_say("enospc"):
                sys.exit(1)
            print(
                f"error: rank {rank()}: no space left on the device of {e.filename or 'the output'}: free space, "
                f"lower --keep-last or choose another --out-dir / --data-cache; the newest complete checkpoint is "
                f"untouched (--resume continues from it)",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(1)
        print(f"error: rank {rank()}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def first_to_say(what, wait_s=5.0):
    """Whether this rank is the job's first to report `what` (one counter in the job's store; True
    without a process group or when the store does not answer within wait_s): a failure every
    rank meets is one line per job, not one per rank."""
    if not tdist.is_initialized():
        return True
    try:
        kv = dist.store()
        kv.set_timeout(datetime.timedelta(seconds=wait_s))
        return kv.add(f"nanomega/said/{what}", 1) == 1
    except Exception:  # the store is gone too: better twice than never
        return True


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
    hosts = sorted(
        {kv.get(f"nanomega/host/{r}").decode() for r in missing if kv.check([f"nanomega/host/{r}"])}
    )
    return (
        f"rank(s) {', '.join(map(str, missing))} on {', '.join(hosts) or 'unknown hosts'} unreachable: a "
        f"collective failed ({first}) and they did not answer through the store within {wait_s:.0f} s; "
        f"the job stops here and resumes from its last checkpoint when restarted (torchrun --max-restarts)"
    )
