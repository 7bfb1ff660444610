"""Exercise peak (lesson 14): find the op that holds the memory peak of a step, from its profiler
trace.

holds_peak(trace): trace, a chrome trace as torch.profiler's export_chrome_trace writes it, parsed
(a dict whose "traceEvents" is a list); it was recorded with profile_memory=True. Return (op,
nbytes, peak): peak, the most bytes alive at once among the blocks allocated inside the trace;
op, the name of the op whose allocations hold the most of them at that moment; nbytes, how many.
The events you need:
    - ops: {"ph": "X", "cat": "cpu_op", "name", "ts" (start, us), "dur", "tid"}; ops nest (an
      aten::linear runs an aten::addmm inside it);
    - memory: {"name": "[memory]", "ts", "tid", "args": {"Bytes", "Addr", ...}}: Bytes > 0 an
      allocation, < 0 a free of the block at that address.
The invariants to build it from:
    - a block belongs to the op that ALLOCATED it, the innermost op around the allocation on its
      thread, for as long as it lives; the op running when it is freed is not its owner (on the CPU
      the profiler sees a free wherever it happens: in AccumulateGrad, in the autograd engine);
    - an address is reused once its block is freed, so a free ends the block that lives there now;
    - a free of a block allocated before the trace began is not in the trace's memory;
    - the file's order is not the time order.

Replaces lessons/14_profiling.py:holds_peak in the tests (tests/test_peak.py: hand-built traces
whose answers are known, each with one of the traps above; one real step, graded against the CPU
allocator's own count and the bytes of lesson 14's formula).
Grade:  python lessons/check.py --exercise peak lessons/exercises/peak.py
"""


def holds_peak(trace):
    raise NotImplementedError("exercise peak: replay the trace's allocations and frees")
