"""The failure policy of one training step, behind one object (Guard), so that train.py's step reads
batches -> forward/backward -> step (OPT-175B's and BLOOM's logbooks: what goes wrong inside a
step).

Every rank must take the same decision at the same step, or the next collective hangs; so each
decision is made from a value all ranks share (the loss agreed over dp, a reduced grad norm) or by a
vote: hangs (Watchdog), NaN/inf and divergence (Skips), loss spikes (Spikes), and the faults tests
inject (--inject-fault, inject_fault, poisoned). The job's half: nanomega/job/faults.py.
Lessons: lessons/19-checkpoints-and-failures.md, lessons/20-when-training-breaks.md
"""

import contextlib
import faulthandler
import math
import os
import signal
import sys
import threading
import time

from nanomega import dist
from nanomega.job import faults, lifecycle


class Guard:
    """What train_step asks at each point of a step; the values it needs, not the flags:
        with guard.forward_backward(model, step, data_step)   beats around it; --inject-fault fires
        on entry
        guard.reported(loss)      this rank's loss as it reports it (x 10 under --inject-fault
        spike)
        guard.spike(loss)         --on-spike's decision, the same on every rank (a vote unless warn)
        guard.drops(spike)        whether engine.step drops this update (--on-spike skip)
        guard.finished(step, loss, info)   --on-nan stop ends the run on a non-finite step; an
                                  update that made the weights non-finite always ends it, before any
                                  save (its count rides the step-boundary vote: guard.vote,
                                  guard.weights_voted)
    and the loop, at the step boundary: guard.count(stepped, step) (--max-skipped),
    guard.may_save(), `with guard.saving(step) as wrap` around a save (the shard's writes are its
    beats), guard.paused() around an evaluation. Built after resume: the watchdog starts here."""

    def __init__(self, grid, spikes, *, on_nan, max_skipped, hang_timeout, out_dir, fault=None):
        self.grid, self.spikes, self.on_nan, self.fault, self.injected = (
            grid,
            spikes,
            on_nan,
            fault,
            None,
        )
        self.skips, self.watchdog = Skips(max_skipped), Watchdog(grid, hang_timeout, out_dir)
        # (step, grad norm, this rank's count of non-finite masters or None)
        self.nonfinite = (0, 0.0, None)

    @property
    def lr_scale(self):
        return self.spikes.lr_scale

    @contextlib.contextmanager
    def forward_backward(self, model, step, data_step):
        self.watchdog.beat(step, "start")
        self.injected = inject_fault(
            self.fault, rank=self.grid.rank, data_step=data_step, step=step
        )
        # this rank's loss: NaN
        with poisoned(model) if self.injected == "nan" else contextlib.nullcontext():
            yield
        self.watchdog.beat(step, "backward done")

    def reported(self, loss):
        # the logged loss; the gradients are the step's own
        return loss * 10 if self.injected == "spike" else loss

    def spike(self, loss):
        """The loss lives on the last pipeline stage: unless --on-spike warn, every rank
        takes its decision."""
        spike = self.spikes.check(loss)
        return lifecycle.grid_agrees(self.grid, spike) if self.spikes.policy != "warn" else spike

    def drops(self, spike):
        return spike and self.spikes.policy == "skip"

    def finished(self, step, loss, info):
        # the vote's: weights_voted
        self.nonfinite = (step, info["grad_norm"], info.get("nonfinite"))
        # before the loop's save: a non-finite checkpoint is never written
        if not info.get("finite", True):
            self.weights_voted(True)
        if self.on_nan == "stop" and not (info["stepped"] and math.isfinite(loss)):
            raise FloatingPointError(
                f"step {step}: loss {loss} / grad norm {info['grad_norm']} not finite; "
                f"stopping (--on-nan stop); the last checkpoint is untouched"
            )

    def vote(self):
        """This step's count of non-finite masters for the step-boundary vote (Saves.at_step_end): 0
        when the engine checked them itself, or did not step."""
        return self.nonfinite[2] if self.nonfinite[2] is not None else 0.0

    def weights_voted(self, broken):
        """The vote found non-finite weights on some rank: stop, before any save."""
        if broken:
            step, norm, _ = self.nonfinite
            raise FloatingPointError(
                f"step {step}: the update made the weights non-finite (grad norm {norm:.3g} "
                f"was finite); stopped before saving, the last checkpoint is untouched: lower "
                f"--lr or --weight-decay and --resume"
            )

    def count(self, stepped, step):
        self.skips.update(stepped, step)

    def may_save(self):
        return self.skips.may_save()

    def paused(self):
        return self.watchdog.paused()

    @contextlib.contextmanager
    def saving(self, step):
        """Around a save: yields wrap(file) for checkpoint.save, whose writes beat (--inject-fault
        hang-save freezes this rank at its first write)."""
        freeze = self.fault == ("hang-save", self.grid.rank, step)
        with self.watchdog.saving(step):
            yield lambda f: Beating(f, self.watchdog.tick, freeze)


class Beating:
    """The shard's file as torch.save sees it: every write (one per record: a header, a whole
    tensor) is a beat, and a tensor's bytes go out in CHUNK pieces, a beat each: one parameter of 10
    GB written at 100 MB/s takes longer than a --hang-timeout."""

    CHUNK = 64 << 20

    def __init__(self, f, tick, freeze=False):
        self.f, self.tick, self.freeze = f, tick, freeze

    def write(self, data):
        if self.freeze:  # testing: a rank frozen in the middle of its save
            os.kill(os.getpid(), signal.SIGSTOP)
        data = memoryview(data).cast("B")  # torch.save hands memoryviews; count bytes
        for i in range(0, len(data), self.CHUNK):
            self.tick()
            self.f.write(data[i : i + self.CHUNK])
        return len(data)

    def flush(self):
        self.f.flush()


class Skips:
    """Consecutive skipped (non-finite) steps: stop past --max-skipped; no checkpoint
    right after a skip."""

    def __init__(self, limit):
        self.limit, self.run = limit, 0

    def update(self, stepped, step):
        self.run = 0 if stepped else self.run + 1
        if self.limit and self.run >= self.limit:
            raise FloatingPointError(
                f"step {step}: {self.run} consecutive steps skipped (non-finite loss or "
                f"gradients; --max-skipped {self.limit}); the run diverged: lower --lr or "
                f"resume from an earlier checkpoint (--resume-from)"
            )

    def may_save(self):
        return self.run == 0


class Spikes:
    """--on-spike. A spike: a finite loss above --spike-threshold x the running mean (an EMA of
    accepted losses). warn logs it; skip drops that step's update (PaLM skipped the batches around
    its spikes); rollback reloads the newest verified checkpoint, keeps the sampler where it is (so
    the data window since that checkpoint is skipped) and scales the lr by --rollback-lr-factor
    (OPT-175B's logbook: ~35 such restarts, each with a lower lr). The lr scale and the skipped
    windows travel in every checkpoint, so later resumes keep them."""

    def __init__(self, policy, threshold, factor):
        self.policy, self.threshold, self.factor = policy, threshold, factor
        self.avg, self.lr_scale, self.windows = None, 1.0, []

    def check(self, loss):
        spike = self.avg is not None and math.isfinite(loss) and loss > self.threshold * self.avg
        if math.isfinite(loss) and not spike:
            self.avg = loss if self.avg is None else 0.9 * self.avg + 0.1 * loss
        return spike

    def rolled_back(self, to_step, spike_step):
        self.windows.append((to_step + 1, spike_step))
        self.lr_scale *= self.factor
        faults.say(
            f"step {spike_step}: loss spike; rolled back to step {to_step}, the data of steps {to_step + 1}-"
            f"{spike_step} skipped, lr x {self.lr_scale:g}"
        )

    def state_dict(self):
        return dict(lr_scale=self.lr_scale, windows=list(self.windows))

    def load_state_dict(self, state):
        if state:
            self.lr_scale, self.windows = state["lr_scale"], list(state["windows"])


# --inject-fault KIND (inject_fault)
FAULTS = ("raise", "nan", "sigterm", "hang", "hang-save", "spike")


def parse_fault(text):
    """--inject-fault KIND:RANK:STEP as (kind, rank, step)."""
    kind, *where = text.split(":")
    if kind not in FAULTS or len(where) != 2 or not all(w.isdigit() for w in where):
        raise ValueError(
            f"--inject-fault {text!r}: expected KIND:RANK:STEP, KIND one of {', '.join(FAULTS)}"
        )
    return kind, int(where[0]), int(where[1])


def inject_fault(fault, *, rank, data_step, step):
    """--inject-fault KIND:RANK:STEP (testing the policies of this file): on that rank at that data
    step, raise, or send itself SIGTERM (a preemption notice mid-step) or SIGSTOP (a frozen rank).
    Returns KIND there, else None: nan and spike are the caller's to apply (see poisoned, and the
    logged loss x 10)."""
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
    """--inject-fault nan: inside, the output of this rank's first block is NaN, so its loss and
    every gradient are (the engine skips the step; --on-nan stop ends the run). Under a pipeline the
    NaN flows to the last stage."""
    block = next(iter(model.blocks.values()))
    handle = block.register_forward_hook(lambda module, inputs, output: output * float("nan"))
    try:
        yield
    finally:
        handle.remove()


class Watchdog:
    """Hang detection (the NCCL flight recorder's question, "who did not arrive?", answered on CPU).

    Each rank records its progress (step, phase) in torchrun's store at every beat. A save beats at
    every write of its shard (tick), and a rank that has written its shard waits at the manifest's
    barrier for the others: while any rank's save still writes (one counter in the store,
    hang/writes), that wait is not a hang. A rank frozen in its save stops every write: named as in
    a step. A thread on each rank wakes when no beat came for --hang-timeout seconds: it dumps this
    rank's Python stacks (faulthandler) to OUT/hang/rank_K.txt and checks in under hang/alive/K;
    after a grace period the lowest live rank names the ranks that never checked in (frozen or dead)
    and those behind the furthest progress, writes OUT/hang/report.txt, and every live rank exits
    non-zero, so that --max-restarts restarts the job. Armed once the first step's backward is done:
    before, the step-0 evaluation and the first step's warm-up (a cold --compile on ranks sharing
    cores, the first CUDA kernels) may take far longer than a step, and only the collective timeout
    bounds a hang."""

    PHASES = ("start", "backward done", "saving")
    EXIT_CODE = 4

    def __init__(self, grid, timeout, out_dir):
        self.timeout, self.grid, self.out_dir = timeout, grid, out_dir
        self.store = dist.store()  # reachable when collectives are not
        # unarmed: see above
        self.last, self.where, self.stopped = float("inf"), (0, 0), threading.Event()
        # a save: when this rank last told the store, the job's count
        self.in_save, self.told, self.writes = False, 0.0, None
        if self.timeout:
            lifecycle.at_job_end(self.stop)
            threading.Thread(target=self._watch, name="nanomega-watchdog", daemon=True).start()

    def beat(self, step, phase):
        # armed, or a backward was done before this beat
        armed = self.last != float("inf") or self.where[1] == 1
        self.last, self.where = (
            time.monotonic() if armed else float("inf"),
            (step, self.PHASES.index(phase)),
        )
        if self.timeout:
            self.store.set(f"hang/progress/{self.grid.rank}", f"{step} {self.where[1]}")

    def stop(self):
        self.stopped.set()

    @contextlib.contextmanager
    def saving(self, step):
        """Around a save (and --async-save's final wait): beats come from its writes
        (tick), not from steps."""
        self.beat(step, "saving")
        self.writes, self.in_save = self._job_writes(), True
        try:
            yield
        finally:
            self.in_save, self.last = False, time.monotonic()

    def tick(self):
        """A write of this rank's shard: progress. The store hears of it at most ten times per
        timeout (a write can be a few bytes: a record's header)."""
        if not self.in_save:  # --async-save's writer during training: the steps beat
            return
        self.last = now = time.monotonic()
        if self.timeout and now - self.told >= self.timeout / 10:
            self.told = now
            # the count with our own writes: only others' change it
            self.writes = self.store.add("hang/writes", 1)

    def _job_writes(self):
        return self.store.add("hang/writes", 0) if self.timeout else 0  # add 0: read a counter

    @contextlib.contextmanager
    def paused(self):
        """Around a save or an evaluation, which may take longer than a step (the collective timeout
        still bounds them)."""
        self.last = float("inf")
        try:
            yield
        finally:
            self.last = time.monotonic()

    def _watch(self):
        while not self.stopped.wait(min(1.0, self.timeout / 10)):
            if time.monotonic() - self.last > self.timeout:
                if self.in_save and self.writes != (writes := self._job_writes()):
                    # another rank is still writing its shard
                    self.writes, self.last = writes, time.monotonic()
                    continue
                self._report()

    def _report(self):
        rank, world = self.grid.rank, self.grid.world
        folder = os.path.join(self.out_dir, "hang")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank_{rank}.txt"), "w") as f:
            f.write(
                f"rank {rank}: no progress for {self.timeout:g} s at step {self.where[0]} "
                f"({self.PHASES[self.where[1]]}); Python stacks:\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)

        # check in, then wait for the other live ranks
        self.store.set(f"hang/alive/{rank}", "1")
        time.sleep(max(2.0, 0.25 * self.timeout))  # let the other live ranks' watchdogs check in
        alive = [r for r in range(world) if self.store.check([f"hang/alive/{r}"])]

        # the lowest live rank writes the report
        if rank == min(alive):
            progress = {
                r: tuple(int(x) for x in self.store.get(f"hang/progress/{r}").split())
                if self.store.check([f"hang/progress/{r}"])
                else (0, -1)
                for r in range(world)
            }
            furthest = max(progress.values())
            silent = [r for r in range(world) if r not in alive]
            behind = [r for r in alive if progress[r] < furthest]
            line = (
                f"hang: no progress for {self.timeout:g} s (--hang-timeout); furthest: step {furthest[0]} "
                f"({self.PHASES[furthest[1]]}); ranks {silent} did not answer (frozen or dead); ranks {behind} "
                f"did not reach that point; stacks of the live ranks in {folder}/"
            )
            if not silent and not behind:
                line += "; every rank reached it: a collective itself stalled"
            with open(os.path.join(folder, "report.txt"), "w") as f:
                f.write(line + "\n")
            print(line, file=sys.stderr, flush=True)

        os._exit(self.EXIT_CODE)  # the main thread is stuck in a collective: leave without it
