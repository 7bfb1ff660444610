"""Lesson 14's "find the op that holds the peak" (lessons/14_profiling.py:holds_peak): the live bytes
of a profiler trace replayed from its allocations and frees, and the op whose allocations hold most
of them at the peak. One process; these are also the `peak` exercise's tests (lessons/grade.py).

Claims:
    built traces   hand-written memory views whose answer is known by construction, each with one
                   trap: a free that happens inside another op (the CPU profiler attributes a free to
                   whatever op runs then), an address reused after its free, a free of a block
                   allocated before the trace, nested ops (the innermost allocates), events stored
                   out of time order
    a real step    one forward + backward of an eager-attention model at s = 128 (lesson 14's PEAK):
                   the peak equals the CPU allocator's own running count (`Total Allocated`), and the
                   op holding most of it is aten::_softmax with L x 4 b a s^2 bytes, each layer's
                   probabilities P, saved for backward until that layer's backward (the peak falls in
                   the last layer's attention backward, while every P is alive)
"""

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lessons"))
lesson = importlib.import_module("14_profiling")  # the exercise's substitution, when graded


def op(name, ts, dur, tid=1):
    return dict(ph="X", cat="cpu_op", name=name, ts=ts, dur=dur, pid=1, tid=tid)


def mem(ts, nbytes, addr, tid=1):
    return dict(ph="i", name="[memory]", ts=ts, pid=1, tid=tid, args=dict(Bytes=nbytes, Addr=addr))


FREED_IN_C = [op("A", 0, 10), mem(1, 100, 1), op("B", 20, 10), mem(21, 60, 2), op("C", 40, 10)]
FREED_IN_C += [mem(41, -100, 1), mem(42, 120, 3)]
# name: (events, (op, bytes it holds at the peak, peak))
BUILT = {
    # A's 100 B block is freed inside op C, which then allocates 120 B: the peak is B's 60 + C's
    # 120; charging the free to C (the op running then) would leave C 20 and A 100
    "a free inside another op": (FREED_IN_C, ("C", 120, 180)),
    # address 1 is freed, then reused by D's 90 B block: the later free of address 1 is D's
    "an address reused after its free": (
        [op("A", 0, 10), mem(1, 50, 1), mem(2, -50, 1), op("D", 20, 10), mem(21, 90, 1)]
        + [op("E", 40, 10), mem(41, 70, 2), mem(42, -90, 1), mem(43, 40, 3)],
        ("D", 90, 160),
    ),
    # a block allocated before the trace (address 9) is freed first: not counted, the peak is
    # what the trace allocated
    "a free of a block allocated before the trace": (
        [op("F", 0, 10), mem(1, -1000, 9), mem(2, 80, 1), op("G", 20, 10), mem(21, 30, 2)],
        ("F", 80, 110),
    ),
    # aten::linear calls aten::addmm, which allocates: the innermost op holds the block
    "nested ops": (
        [op("aten::linear", 0, 30), op("aten::addmm", 5, 10), mem(6, 64, 1)]
        + [op("aten::add", 40, 10), mem(41, 32, 2)],
        ("aten::addmm", 64, 96),
    ),
    # the memory view of "a free inside another op", its events stored in reverse
    "events stored out of time order": (
        list(reversed(FREED_IN_C)),
        ("C", 120, 180),
    ),
}


@pytest.mark.parametrize("case", BUILT)
def test_holds_peak_of_a_built_trace(case):
    events, want = BUILT[case]
    got = tuple(lesson.holds_peak({"traceEvents": events}))
    assert got == want, f"{case}: got (op, bytes, peak) = {got}, want {want}"


def test_holds_peak_of_an_eager_attention_step(tmp_path):
    c, b = lesson.PEAK, 1
    trace = lesson.peak_trace(str(tmp_path / "peak.json"), c, b)
    got = tuple(lesson.holds_peak(trace))
    want = ("aten::_softmax", c.n_layer * 4 * b * c.n_head * c.block_size**2)
    want = (*want, lesson.allocator_peak(trace))
    assert got == want, f"one step at s={c.block_size}: got (op, bytes, peak) = {got}, want {want}"
