"""Lesson 14: profiling one training step -- torch.profiler's trace of compute and communication,
and its memory view.

One data-parallel step (2 gloo ranks: forward, backward, the gradient all-reduce, AdamW) under
torch.profiler on the CPU. The top ops by time are printed (they depend on the CPU); the checks are
what does not: the matmul FLOPs the profiler counts against the formula, the all-reduce it records
against the calls made, and the bytes its memory view shows for the attention's batched matmuls --
the s x s scores included. Then the op that holds the memory peak of one forward + backward, found
by replaying the trace's allocations and frees (holds_peak).
Run from the repository root: python lessons/14_profiling.py
"""

import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from check import check  # noqa: E402
from nanomega import dist, worlds  # noqa: E402
from nanomega.gpt_config import GPTConfig  # noqa: E402
from nanomega.model import GPT  # noqa: E402

# vocabulary, sequence, layers, heads, hidden, micro-batch per rank
V, S, L, A, H, B = 512, 64, 2, 4, 128, 4
CFG = GPTConfig(
    vocab_size=V, block_size=S, n_layer=L, n_head=A, n_embd=H, dropout=0.0, attention="eager"
)

# the peak-memory step: one process, eager attention at a sequence long enough that each layer's
# (b, a, s, s) probabilities are its largest tensors
PEAK = GPTConfig(
    vocab_size=128, block_size=128, n_layer=2, n_head=4, n_embd=32, dropout=0.0, attention="eager"
)


def step(model, opt, grid, x):
    """One data-parallel training step, each phase named in the trace."""
    with record_function("forward"):
        loss = model(x, x)
    with record_function("backward"):
        loss.backward()
    with record_function("gradient all-reduce"):
        # one bucket: one all-reduce
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        grid.dp.all_reduce(flat)
        offset = 0
        for p in model.parameters():
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p) / grid.dp.size)
            offset += p.numel()
    with record_function("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=False)


def profiled(trace_dir):
    torch.manual_seed(0)  # the same weights on both ranks, different data
    grid = dist.Grid(dp=2)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(grid.rank))
    # warm-up: the first step allocates the optimizer state and the buffers
    step(model, opt, grid, x)
    with profile(
        activities=[ProfilerActivity.CPU], with_flops=True, profile_memory=True, record_shapes=True
    ) as prof:
        step(model, opt, grid, x)
    events = prof.key_averages()
    if grid.rank == 0:
        prof.export_chrome_trace(os.path.join(trace_dir, "step_rank0.json"))
    by = {e.key: e for e in events}
    # torch's op for every backend
    collectives = by["c10d::allreduce_"].count if "c10d::allreduce_" in by else 0
    return dict(
        table=events.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=28),
        flops=sum(by[k].flops for k in ("aten::mm", "aten::addmm", "aten::bmm") if k in by),
        bmm_bytes=by["aten::bmm"].self_cpu_memory_usage,
        collectives=collectives,
        backend=by["gloo:all_reduce"].count if "gloo:all_reduce" in by else 0,
        phases={
            k: by[k].cpu_time_total / 1e3
            for k in ("forward", "backward", "gradient all-reduce", "optimizer")
        },
    )


def peak_trace(path, cfg=PEAK, b=1):
    """One forward + backward of cfg's model under the profiler's memory view (after a warm-up
    one, so the gradients exist): the chrome trace written to path and returned, parsed."""
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size))
    model(x, x).backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x, x).backward()
    prof.export_chrome_trace(path)
    with open(path) as f:
        return json.load(f)


def holds_peak(trace):
    """(op, bytes, peak) of a chrome trace's memory view: the live bytes at their highest (peak:
    blocks allocated inside the trace), and the op whose allocations hold most of them then.
    Replay the `[memory]` events in time order: +Bytes an allocation, -Bytes a free, paired by
    address (an address is reused after its free). A free is not attributed to the op running when
    it happens (on the CPU that is whatever op ran: AccumulateGrad, the autograd engine): the block
    belongs to the op that allocated it, the innermost op (`ph` X) enclosing the allocation on its
    thread. A free of a block allocated before the trace began is skipped."""
    events = trace["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])

    def allocator(e):  # the innermost op enclosing e on its thread (the latest to start)
        around = [
            o for o in ops if o["tid"] == e["tid"] and o["ts"] <= e["ts"] <= o["ts"] + o["dur"]
        ]
        return max(around, key=lambda o: o["ts"])["name"] if around else "(no op)"

    live, now, peak, at_peak = {}, 0, 0, {}  # live: address -> (bytes, op)
    for e in memory:
        nbytes, address = e["args"]["Bytes"], e["args"]["Addr"]
        if nbytes > 0:
            live[address] = (nbytes, allocator(e))
            now += nbytes
        elif address in live:
            now -= live.pop(address)[0]
        if now > peak:
            peak, at_peak = now, dict(live)
    held = {}
    for nbytes, op in at_peak.values():
        held[op] = held.get(op, 0) + nbytes
    op = max(held, key=held.get) if held else "(no op)"
    return op, held.get(op, 0), peak


def allocator_peak(trace):
    """The peak by the CPU allocator's own running count (each event's `Total Allocated`), above
    its value when the trace began: what holds_peak's replay must reproduce."""
    memory = sorted(
        (e for e in trace["traceEvents"] if e.get("name") == "[memory]"), key=lambda e: e["ts"]
    )
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in memory) - start


if __name__ == "__main__":
    trace_dir = tempfile.mkdtemp(prefix="nanomega-trace-")
    r = worlds.launch(profiled, 2, trace_dir)[0]
    print("rank 0, one step, top ops by self CPU time (this CPU's; yours differ):")
    print(r["table"])
    print("phases, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items()))
    print(
        f"trace: {trace_dir}/step_rank0.json (open in https://ui.perfetto.dev or chrome://tracing)"
    )
    # the weight matrices a matmul multiplies (the tied head once)
    n_matrices = L * 12 * H * H + V * H
    tokens = B * S
    check(
        "profiler's matmul FLOPs (mm, addmm, bmm) = (6 N_matrices + 12 L h s) x tokens",
        r["flops"],
        (6 * n_matrices + 12 * L * H * S) * tokens,
    )
    print(
        f"communication in the trace: c10d::allreduce_ x{r['collectives']} (the op) and gloo:all_reduce "
        f"x{r['backend']} (the backend's work)"
    )
    check("profiler's all-reduce calls in the step = 1 (one bucket)", r["collectives"], 1)
    hd = H // A
    check(
        "memory view: bytes aten::bmm allocates = L x 4 b a (2 s^2 + 4 s hd) (scores, P V and their gradients)",
        r["bmm_bytes"],
        L * 4 * B * A * (2 * S * S + 4 * S * hd),
    )

    # the op that holds the peak: each layer's probabilities P, saved for backward (softmax's and
    # P V's), live until that layer's backward; the peak falls in the last layer's attention backward
    trace = peak_trace(os.path.join(trace_dir, "peak.json"))
    op, held, peak = holds_peak(trace)
    c, b = PEAK, 1
    print(
        f"memory peak of one forward + backward (s = {c.block_size}, eager): {peak:,} B live, "
        f"{held:,} B of them allocated by {op}"
    )
    check(
        "peak found by replaying the trace's allocations and frees = the allocator's own count",
        peak,
        allocator_peak(trace),
        labels=("replayed", "allocator's"),
    )
    check(
        f"bytes {op} holds at the peak = L x 4 b a s^2 (every layer's saved probabilities)",
        held,
        c.n_layer * 4 * b * c.n_head * c.block_size**2,
    )
