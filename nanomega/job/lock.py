"""One job per out-dir: an flock on OUT/.lock, kept across torchrun's restarts of its job.

Rank 0 takes an exclusive flock; a second job is refused with one line. The kernel drops an flock
when its last descriptor closes (no stale lock after a crash), which under `torchrun --max-restarts`
leaves a gap while the workers restart; so under torchrun a tiny holder process shares the
descriptor while the agent lives, and the restarted rank 0 of the same job (the same run id) adopts
the lock.
Lesson: lessons/19-checkpoints-and-failures.md
"""

import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import time

HOLDER_POLL = 0.2  # seconds between the holder's checks that the agent lives
DYING_WAIT = 5.0  # seconds to wait for the lock of a job whose agent has just died on this host
HOLDER = f"""
import os, sys, time
agent = int(sys.argv[1])
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a dead agent not yet reaped by its parent is a zombie, not alive
        return open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
while alive(agent):
    time.sleep({HOLDER_POLL})
"""
_LOCKS = {}  # realpath of the out-dir -> (open lock file, holder: Popen, a pid adopted, or None)


def torchrun_job():
    """(run id, host, agent pid) of this process's torchrun job, or None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return (run_id, socket.gethostname(), os.getppid()) if run_id else None


def restart_follows():
    """Whether torchrun will restart the workers after this one fails (restarts left)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) < int(
        os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)
    )


def _holder_of(text):
    """(run id, host, agent, holder pid) from the lock file's line, or None (a plain flock, no
    holder)."""
    m = re.search(r"on (\S+); torchrun job (\S+) agent (\d+) holder (\d+)", text)
    return (m.group(2), m.group(1), int(m.group(3)), int(m.group(4))) if m else None


def _same_job(job, held):
    """The run id names the job; torchrun's default id "none" (no --rdzv-id) names it
    only with its agent."""
    return held[0] == job[0] and (job[0] != "none" or held[1:3] == job[1:])


def _agent_dead(held):
    if held[1] != socket.gethostname():
        return False  # another host's agent: its holder will tell (the lock goes when it exits)
    try:
        os.kill(held[2], 0)
        return False
    except ProcessLookupError:
        return True


def lock_out_dir(out_dir):
    """Take OUT/.lock (exclusive, non-blocking), or adopt it from this job's holder after a torchrun
    restart; another job is refused with one line. Re-entrant within a process."""
    key = os.path.realpath(out_dir)
    if key in _LOCKS:
        return _LOCKS[key][0]

    os.makedirs(out_dir, exist_ok=True)
    f, job, deadline = (
        open(os.path.join(out_dir, ".lock"), "a+"),
        torchrun_job(),
        time.monotonic() + DYING_WAIT,
    )

    # wait out a holder whose agent died; adopt our own job's lock; refuse another job
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            f.seek(0)
            text = f.read().strip()
            held = _holder_of(text)
            # restarted by torchrun: our holder kept the lock for us
            if job and held and _same_job(job, held):
                _LOCKS[key] = (f, held[3])
                return f
            if held and _agent_dead(held) and time.monotonic() < deadline:
                time.sleep(0.05)  # its holder sees the agent gone within HOLDER_POLL and lets go
                continue
            f.close()
            raise ValueError(
                f"--out-dir {out_dir} is in use by another job ({text or 'another process'} holds "
                f"{out_dir}/.lock); wait for it to end or choose another --out-dir"
            ) from None

    holder = None
    if job:  # the holder shares this descriptor (pass_fds), so the lock outlives this process
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(job[2])],
            pass_fds=(f.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    # who holds it, for the next one that asks (_holder_of)
    f.truncate(0)
    f.write(
        f"pid {os.getpid()} on {socket.gethostname()}"
        + (f"; torchrun job {job[0]} agent {job[2]} holder {holder.pid}" if job else "")
        + "\n"
    )
    f.flush()
    _LOCKS[key] = (f, holder)
    return f


def unlock_out_dir(out_dir, keep_for_restart=False):
    """Drop the lock: stop the holder and close our descriptor -- unless keep_for_restart (a failure
    torchrun will restart: the holder keeps the out-dir for the restarted job)."""
    f, holder = _LOCKS.pop(os.path.realpath(out_dir), (None, None))
    if f is not None and holder is not None and not keep_for_restart:
        if isinstance(holder, subprocess.Popen):
            holder.kill()
            holder.wait()
        elif _is_holder(holder):
            # adopted from the previous attempt: not our child; the lock is free once it exits
            os.kill(holder, signal.SIGKILL)
            for _ in range(250):
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.02)
    if f is not None:
        f.close()


def _is_holder(pid):
    """Whether pid still runs HOLDER (a pid is reused once its process is gone: never
    signal a stranger)."""
    try:
        return "agent = int(sys.argv[1])" in open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return False
