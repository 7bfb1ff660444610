"""A pipeline step's timeline drawn: one row per rank, each op a labelled bar, idle time dots.

Idea: a schedules.Trace (simulated on a unit clock, or timed on the wall clock by pp.py) becomes
ASCII text for a terminal or a lesson, and with a path a PNG (matplotlib, when importable): F blue,
B orange, W green; chunk letters a, b, ... when a rank holds more than one model chunk. The bubble
is what the dots show: schedules.bubble_fraction measures it.
Lesson: lessons/08-pipeline-parallel.md
"""


def draw_timeline(traces, path=None, width=None):
    """ASCII timeline, one row per rank ('.' = idle; chunk letters a, b, ... when v > 1). With path,
    also a PNG when matplotlib is importable (not a dependency); the returned text says when none
    was written."""
    events = [e for t in traces for e in t.events]
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    chunked = any(e.chunk for e in events)
    unit_clock = all(float(e.start).is_integer() and float(e.end).is_integer() for e in events)
    width = width or (
        int(t1 - t0) * (1 + max(len(_label(e, chunked)) for e in events)) if unit_clock else 120
    )
    scale = width / (t1 - t0)

    rows = []
    for t in traces:
        row = ["."] * width
        for e in t.events:
            c0 = min(round((e.start - t0) * scale), width - 1)
            c1 = min(max(round((e.end - t0) * scale), c0 + 1), width)
            row[c0:c1] = (_label(e, chunked) + " " * (c1 - c0))[: c1 - c0]
        rows.append(f"rank {t.rank} |{''.join(row)}|")

    text = "\n".join(rows)
    return text + "\n" + _draw_png(traces, path, chunked) if path else text


def _label(e, chunked):
    return f"{e.op}{e.mb}" + (chr(ord("a") + e.chunk) if chunked else "")


def _draw_png(traces, path, chunked):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"(matplotlib is not installed: no PNG written to {path})"
    t0 = min(e.start for t in traces for e in t.events)
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(traces) + 1))
    for t in traces:
        for e in t.events:
            ax.broken_barh(
                [(e.start - t0, e.end - e.start)],
                (t.rank - 0.4, 0.8),
                edgecolor="black",
                color={"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}[e.op],
                linewidth=0.3,
            )
            ax.text(
                e.start - t0 + (e.end - e.start) / 2,
                t.rank,
                _label(e, chunked)[1:],
                ha="center",
                va="center",
                fontsize=7,
            )
    ax.set_yticks(range(len(traces)), [f"rank {t.rank}" for t in traces])
    ax.invert_yaxis()
    ax.set_xlabel("time (blue: forward, orange: backward, green: weight gradients W)")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return f"(timeline PNG written to {path})"
