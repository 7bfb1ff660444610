"""Failures at scale: what a month-long run meets, and the policy for each (OPT-175B's and BLOOM's logbooks).

Idea: a job of N ranks, each failing with probability p per hour, survives an hour with (1-p)^N; at scale
failures are routine, so every one must cost at most one checkpoint interval and never a silent loss:
    one job per out-dir    an flock on OUT/.lock held by rank 0; the kernel drops it when the holder dies
    orphans                a worker asks the kernel for SIGKILL when its torchrun agent dies (PR_SET_PDEATHSIG)
    preemption             SIGTERM/SIGUSR1 set a flag; all ranks agree at the next step boundary (an all-reduce),
                           checkpoint and exit 0 (Slurm sends SIGUSR1 before the end of an allocation)
    divergence             --max-skipped consecutive non-finite steps stop the run non-zero; a checkpoint is
                           never written right after a skipped step (its state came from skipped steps)
    resume                 checkpoint.find_resume: newest verified folder, naming what it skipped and why;
                           metrics.jsonl rows after the resumed step are replaced, not duplicated
    errors                 one line per expected failure; torchrun's error file records the message
    tests of all this      --inject-fault KIND:RANK:STEP: a rank raises, is preempted, freezes, or its loss goes
                           NaN (a forward hook) or spikes, at a chosen step
Lessons: lessons/10-checkpoints-and-failures.md, lessons/12-when-training-breaks.md
"""
import contextlib
import ctypes
import faulthandler
import fcntl
import math
import os
import signal
import socket
import sys
import threading
import time

from nanomega import checkpoint, dist

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def rank():
    return int(os.environ.get("RANK", 0))


def say(message):
    """One line on stderr from rank 0 only: the same line from every rank is noise."""
    if rank() == 0:
        print(message, file=sys.stderr, flush=True)


def check_out_dir(out_dir):
    """--out-dir must be (or be creatable as) a directory: no regular file on its path."""
    path = os.path.abspath(out_dir)
    while path != os.path.dirname(path):
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"--out-dir {out_dir}: {path} is a file, not a directory; choose another --out-dir")
        path = os.path.dirname(path)


_LOCKS = {}  # out-dir -> open lock file: per process, as the flock itself is


def lock_out_dir(out_dir):
    """Take OUT/.lock (exclusive, non-blocking); a second job is refused with one line. The kernel releases
    the lock when this process dies, so a crash never leaves a stale lock. Re-entrant within a process."""
    key = os.path.realpath(out_dir)
    if key in _LOCKS:
        return _LOCKS[key]
    os.makedirs(out_dir, exist_ok=True)
    f = open(os.path.join(out_dir, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ValueError(f"--out-dir {out_dir} is in use by another job ({holder} holds {out_dir}/.lock); "
                         f"wait for it to end or choose another --out-dir") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _LOCKS[key] = f
    return f


def unlock_out_dir(out_dir):
    f = _LOCKS.pop(os.path.realpath(out_dir), None)
    if f:
        f.close()  # closing the descriptor drops the flock


def discover(args, cfg):
    """The checkpoint to resume from (or None), chosen before any collective; rank 0 cleans up first.

    Refuses a checkpoint at or past --max-steps (nothing to do is an error, not a silent no-op)."""
    if rank() == 0:
        lock_out_dir(args.out_dir)
        for path in checkpoint.clean_tmp(args.out_dir):
            say(f"resume: removed {path} (left by a save that did not finish)")
    folder = checkpoint.latest(args.out_dir)
    if folder and not args.resume:
        raise ValueError(f"--out-dir {args.out_dir} already holds a checkpoint ({folder}); "
                         f"pass --resume to continue it or choose another --out-dir")
    if not args.resume:
        return None
    folder, skipped = checkpoint.find_resume(args.out_dir, cfg, args.resume_from)
    for reason in skipped:
        say(f"resume: skipped {reason}")
    if folder is None:
        return None
    step = checkpoint.read_manifest(folder, cfg)["step"]
    if step >= args.max_steps:
        raise ValueError(f"--max-steps {args.max_steps} is at or below the checkpoint's step {step} ({folder}); "
                         f"raise --max-steps to train on")
    if args.resume_from is not None and rank() == 0:
        for moved in checkpoint.set_aside_newer(args.out_dir, step):
            say(f"resume: moved {moved} (newer than step {step}) to {args.out_dir}/ckpt/abandoned/")
    return folder


class Skips:
    """Consecutive skipped (non-finite) steps: stop past --max-skipped; no checkpoint right after a skip."""

    def __init__(self, limit):
        self.limit, self.run = limit, 0

    def update(self, stepped, step):
        self.run = 0 if stepped else self.run + 1
        if self.limit and self.run >= self.limit:
            raise FloatingPointError(f"step {step}: {self.run} consecutive steps skipped (non-finite loss or "
                                     f"gradients; --max-skipped {self.limit}); the run diverged: lower --lr or "
                                     f"resume from an earlier checkpoint (--resume-from)")

    def may_save(self):
        return self.run == 0


class Spikes:
    """--on-spike. A spike: a finite loss above --spike-threshold x the running mean (an EMA of accepted losses).
    warn logs it; skip drops that step's update (PaLM skipped the batches around its spikes); rollback reloads
    the newest verified checkpoint, keeps the sampler where it is (so the data window since that checkpoint
    is skipped) and scales the lr by --rollback-lr-factor (OPT-175B's logbook: ~35 such restarts, each with a
    lower lr). The lr scale and the skipped windows travel in every checkpoint, so later resumes keep them."""

    def __init__(self, args):
        self.policy, self.threshold, self.factor = args.on_spike, args.spike_threshold, args.rollback_lr_factor
        self.avg, self.lr_scale, self.windows = None, 1.0, []

    def check(self, loss):
        spike = self.avg is not None and math.isfinite(loss) and loss > self.threshold * self.avg
        if math.isfinite(loss) and not spike:
            self.avg = loss if self.avg is None else 0.9 * self.avg + 0.1 * loss
        return spike

    def rolled_back(self, to_step, spike_step):
        self.windows.append((to_step + 1, spike_step))
        self.lr_scale *= self.factor
        say(f"step {spike_step}: loss spike; rolled back to step {to_step}, the data of steps {to_step + 1}-"
            f"{spike_step} skipped, lr x {self.lr_scale:g}")

    def state_dict(self):
        return dict(lr_scale=self.lr_scale, windows=list(self.windows))

    def load_state_dict(self, state):
        if state:
            self.lr_scale, self.windows = state["lr_scale"], list(state["windows"])


def inject_fault(fault, *, rank, data_step, step):
    """--inject-fault KIND:RANK:STEP (testing the policies above): on that rank at that data step, raise, or send
    itself SIGTERM (a preemption notice mid-step) or SIGSTOP (a frozen rank). Returns KIND there, else None:
    nan and spike are the caller's to apply (see poisoned, and the logged loss x 10)."""
    if not fault or fault[1:] != (rank, data_step):
        return None
    kind = fault[0]
    if kind == "raise":
        raise RuntimeError(f"--inject-fault: rank {rank} raises at step {step}")
    if kind in ("sigterm", "hang"):
        os.kill(os.getpid(), signal.SIGTERM if kind == "sigterm" else signal.SIGSTOP)
    return kind


@contextlib.contextmanager
def poisoned(model):
    """--inject-fault nan: inside, the output of this rank's first block is NaN, so its loss and every gradient
    are (the engine skips the step; --on-nan stop ends the run). Under a pipeline the NaN flows to the last stage."""
    block = next(iter(model.blocks.values()))
    handle = block.register_forward_hook(lambda module, inputs, output: output * float("nan"))
    try:
        yield
    finally:
        handle.remove()


_PREEMPTED, _OLD_HANDLERS = [], {}


def _on_signal(signum, frame):
    if _PREEMPTED:  # a second signal: stop now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    _PREEMPTED.append(signum)


def arm_preemption():
    """From the first training step on, SIGTERM/SIGUSR1 mean: checkpoint at the next step boundary. Not
    before: a Python handler cannot run while C++ blocks (a rendezvous), and the default action must end it."""
    if threading.current_thread() is threading.main_thread():
        for s in PREEMPT_SIGNALS:
            _OLD_HANDLERS.setdefault(s, signal.signal(s, _on_signal))


def preempt_requested():
    return bool(_PREEMPTED)


def saved(args, resumed_from, grid):
    """After a complete save: rank 0 applies --keep-last (never the folder this run resumed from)."""
    if args.keep_last and grid.rank == 0:
        for folder in checkpoint.retain(args.out_dir, args.keep_last, protect=[resumed_from]):
            say(f"--keep-last {args.keep_last}: removed {folder}")


def die_with_parent():
    """Under torchrun, ask the kernel to SIGKILL this worker when its agent dies (no orphan trains on)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent or parent == 1:  # the agent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


class Watchdog:
    """Hang detection (the NCCL flight recorder's question, "who did not arrive?", answered on CPU).

    Each rank records its progress (step, phase) in torchrun's store at every beat. A thread on each rank
    wakes when no beat came for --hang-timeout seconds: it dumps this rank's Python stacks (faulthandler) to
    OUT/hang/rank_K.txt and checks in under hang/alive/K; after a grace period the lowest live rank names the
    ranks that never checked in (frozen or dead) and those behind the furthest progress, writes
    OUT/hang/report.txt, and every live rank exits non-zero, so that --max-restarts restarts the job."""

    PHASES = ("start", "backward done")
    EXIT_CODE = 4

    def __init__(self, args, grid):
        import torch.distributed as tdist
        self.timeout, self.grid, self.out_dir = args.hang_timeout, grid, args.out_dir
        self.store = tdist.distributed_c10d._get_default_store()
        self.last, self.where, self.stopped = time.monotonic(), (0, 0), threading.Event()
        if self.timeout:
            _WATCHDOGS.append(self)
            threading.Thread(target=self._watch, name="nanomega-watchdog", daemon=True).start()

    def beat(self, step, phase):
        self.last, self.where = time.monotonic(), (step, self.PHASES.index(phase))
        if self.timeout:
            self.store.set(f"hang/progress/{self.grid.rank}", f"{step} {self.where[1]}")

    def stop(self):
        self.stopped.set()

    @contextlib.contextmanager
    def paused(self):
        """Around a save or an evaluation, which may take longer than a step (the collective timeout still
        bounds them)."""
        self.last = float("inf")
        try:
            yield
        finally:
            self.last = time.monotonic()

    def _watch(self):
        while not self.stopped.wait(min(1.0, self.timeout / 10)):
            if time.monotonic() - self.last > self.timeout:
                self._report()

    def _report(self):
        rank, world = self.grid.rank, self.grid.world
        folder = os.path.join(self.out_dir, "hang")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank_{rank}.txt"), "w") as f:
            f.write(f"rank {rank}: no progress for {self.timeout:g} s at step {self.where[0]} "
                    f"({self.PHASES[self.where[1]]}); Python stacks:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        self.store.set(f"hang/alive/{rank}", "1")
        time.sleep(max(2.0, 0.25 * self.timeout))  # let the other live ranks' watchdogs check in
        alive = [r for r in range(world) if self.store.check([f"hang/alive/{r}"])]
        if rank == min(alive):
            progress = {r: tuple(int(x) for x in self.store.get(f"hang/progress/{r}").split())
                        if self.store.check([f"hang/progress/{r}"]) else (0, -1) for r in range(world)}
            furthest = max(progress.values())
            silent = [r for r in range(world) if r not in alive]
            behind = [r for r in alive if progress[r] < furthest]
            line = (f"hang: no progress for {self.timeout:g} s (--hang-timeout); furthest: step {furthest[0]} "
                    f"({self.PHASES[furthest[1]]}); ranks {silent} did not answer (frozen or dead); ranks {behind} "
                    f"did not reach that point; stacks of the live ranks in {folder}/")
            if not silent and not behind:
                line += "; every rank reached it: a collective itself stalled"
            with open(os.path.join(folder, "report.txt"), "w") as f:
                f.write(line + "\n")
            print(line, file=sys.stderr, flush=True)
        os._exit(self.EXIT_CODE)  # the main thread is stuck in a collective: leave without it


_WATCHDOGS = []


@contextlib.contextmanager
def job(args):
    """Around train.main: no orphans; afterwards the signal handlers restored and the out-dir lock released."""
    _PREEMPTED.clear()
    die_with_parent()
    try:
        yield
    finally:
        while _WATCHDOGS:
            _WATCHDOGS.pop().stop()
        for s in list(_OLD_HANDLERS):
            signal.signal(s, _OLD_HANDLERS.pop(s))
        unlock_out_dir(args.out_dir)


def _peer_failure(e):
    """An error seen because ANOTHER rank died (a broken collective): that rank tells the story."""
    import torch.distributed as tdist
    text = str(e).lower()
    return isinstance(e, tdist.DistError) or any(
        m in text for m in ("connection closed by peer", "connection reset", "broken pipe", "gloo"))


def entrypoint(main):
    """Run main as a script: an expected failure is one line (from rank 0 when every rank fails the same way,
    else from the rank that failed) and, under torchrun, recorded in the error file its summary shows."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler
    handler = get_error_handler()
    handler.initialize()
    try:
        main()
    except (ValueError, FileNotFoundError, FloatingPointError) as e:  # the same on every rank: rank 0 says it
        handler.record_exception(e)
        say(f"error: {e}")
        sys.exit(2 if not isinstance(e, FloatingPointError) else 3)
    except (OSError, RuntimeError) as e:
        line = dist.lost_ranks(e) if isinstance(e, RuntimeError) else None
        if line is not None:  # a collective failed and ranks no longer answer: rank 0 names them, once
            if line:
                handler.record_exception(e)
                print(f"error: {line}", file=sys.stderr, flush=True)
            sys.exit(1)
        if _peer_failure(e):
            sys.exit(1)  # quiet: the rank that failed first prints, and torchrun names it as the root cause
        handler.record_exception(e)
        print(f"error: rank {rank()}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
