"""DualPipe's MoE overlap: in an overlapped pair, one micro-batch's all-to-all runs while the other
micro-batch computes.

Idea (DeepSeek-V3 technical report, sec. 3.2.1): a pair is the forward of micro-batch a and the
backward of micro-batch b (dualpipe.py). Each side is a coroutine (a thread; only the side holding
the turn runs): when a side has issued an expert all-to-all without waiting (ep.py's dispatch and
combine and their backwards call ep.OVERLAP) it hands the turn to the other side, which computes
until it issues its own, and only then is the first side's all-to-all waited for. The order of
every collective is the same on every rank (the hand-offs are), so nothing deadlocks. On a CPU
nothing overlaps (gloo's all-to-all and the compute share the cores): what this module gives, and
what tests/test_dualpipe.py checks in its LOG, is the order. The time saved needs a GPU.
    per MoE layer of a pair: issue(a2a of one side) -> compute(other side) -> wait(a2a)
Lesson: lessons/08-pipeline-parallel.md
"""

import threading

from . import ep

ENABLED = True  # False: a pair runs its forward, then its backward (no hand-offs)
LOG = []  # (event, side) while a test records: "issue", "run" (has the turn), "wait", "end"
RECORD = []  # non-empty: LOG records
_ACTIVE = threading.local()  # this thread's pair and side while a pair runs


def handoff():
    """Called by a side right after it issued an all-to-all: the other side runs until it hands
    the turn back (or ends). A no-op outside a pair."""
    pair, side = getattr(_ACTIVE, "pair", None), getattr(_ACTIVE, "side", None)
    if pair is not None:
        pair.switch(side)


def waited():
    """Called after the all-to-all was waited for (the log's "wait")."""
    side = getattr(_ACTIVE, "side", None)
    if side is not None and RECORD:
        LOG.append(("wait", side))


class Pair:
    """Two sides, "F" (the forward, on a worker thread) and "B" (the backward, on the calling
    thread: CPU autograd runs its backward there), one holding the turn at a time; F starts."""

    def __init__(self):
        self.cond, self.turn, self.ended = threading.Condition(), "F", set()

    def switch(self, side):
        other = "B" if side == "F" else "F"
        with self.cond:
            if RECORD:
                LOG.append(("issue", side))
            if other in self.ended:
                return
            self.turn = other
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == side)
            if RECORD:
                LOG.append(("run", side))

    def side(self, name, work):
        """Run work() as side `name` once it has the turn; hand the turn over for good at the end."""
        _ACTIVE.pair, _ACTIVE.side = self, name
        try:
            with self.cond:
                self.cond.wait_for(lambda: self.turn == name)
                if RECORD:
                    LOG.append(("run", name))
            return work()
        finally:
            _ACTIVE.pair = _ACTIVE.side = None
            with self.cond:
                if RECORD:
                    LOG.append(("end", name))
                self.ended.add(name)
                self.turn = "B" if name == "F" else "F"
                self.cond.notify_all()


def run_pair(forward, backward):
    """forward() and backward() of an overlapped pair, interleaved at their all-to-alls (ENABLED),
    else one after the other. Returns forward()'s result; an error on either side is raised."""
    if not ENABLED:
        return forward(), backward()
    ep.OVERLAP.update(issued=handoff, waited=waited)  # no-ops outside a pair
    pair, result, error = Pair(), [], []

    def run_forward():
        try:
            result.append(pair.side("F", forward))
        except BaseException as e:  # raised again on the calling thread
            error.append(e)

    thread = threading.Thread(target=run_forward, name="dualpipe-forward")
    thread.start()
    try:
        back = pair.side("B", backward)
    finally:
        thread.join()
    if error:
        raise error[0]
    return result[0], back
