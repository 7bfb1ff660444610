"""Solution of the peak exercise: lessons/14_profiling.py:holds_peak."""


def holds_peak(trace):
    events = trace["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])

    def allocator(e):  # the innermost op enclosing e on its thread: the latest to start
        around = [
            o for o in ops if o["tid"] == e["tid"] and o["ts"] <= e["ts"] <= o["ts"] + o["dur"]
        ]
        return max(around, key=lambda o: o["ts"])["name"] if around else "(no op)"

    # replay in time order; a free ends the block living at its address, whoever runs then
    live, now, peak, at_peak = {}, 0, 0, {}  # live: address -> (bytes, op)
    for e in memory:
        nbytes, address = e["args"]["Bytes"], e["args"]["Addr"]
        if nbytes > 0:
            live[address] = (nbytes, allocator(e))
            now += nbytes
        elif address in live:  # else allocated before the trace
            now -= live.pop(address)[0]
        if now > peak:
            peak, at_peak = now, dict(live)

    held = {}
    for nbytes, op in at_peak.values():
        held[op] = held.get(op, 0) + nbytes
    op = max(held, key=held.get) if held else "(no op)"
    return op, held.get(op, 0), peak
