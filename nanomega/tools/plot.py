"""Pictures of runs: PNGs drawn from the runs' metrics.jsonl.

    python -m nanomega.tools.plot OUT [OUT2 ...] [--to DIR]

    loss.png        train and validation loss against steps and against tokens, the runs overlaid
                    (e.g. a tp x pp layout on top of the dense run: the curves must coincide)
    throughput.png  tokens/s, MFU, memory (mem_gib, when the run logged it), the learning rate
    timeline_<run>.png
                    the pipeline schedule of a real run (pp > 1), drawn like the lesson's
                    simulated ones (timeline.draw_timeline)
Needs the `plot` extra (matplotlib). Fields a run did not log are left out, never invented.
The lessons' figures are made this way from real runs by `python scripts/figures.py`.
Lesson: lessons/01-dense-model.md
"""

import argparse
import json
import os
from pathlib import Path

from nanomega import schedules, timeline
from nanomega.job import lifecycle


def read_run(out):
    """(train rows, val rows) of OUT/metrics.jsonl, the last row per step kept (a resumed run
    rewrites steps)."""
    path = Path(out) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{out} has no metrics.jsonl; pass the --out-dir of a train.py run")
    rows = {}
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            rows[r["step"]] = {**rows.get(r["step"], {}), **r}
    rows = [rows[k] for k in sorted(rows)]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def read_traces(out):
    """The pipeline stages' schedules.Trace of one step, or [] when the run had no pipeline."""
    folder = Path(out) / "pipeline_trace"
    traces = []
    for path in sorted(folder.glob("rank_*.json")) if folder.is_dir() else []:
        d = json.loads(path.read_text())
        t = schedules.Trace(d["rank"])
        t.events = [schedules.Event(**e) for e in d["events"]]
        traces.append(t)
    return traces


def _names(outs):
    names = [Path(o).resolve().name for o in outs]
    return names if len(set(names)) == len(names) else [str(o) for o in outs]


def _series(ax, runs, key, x="step", val=False, suffix="", **kw):
    """Plot `key` against `x` for every run that logged both; returns whether anything was drawn."""
    drawn = False
    for name, (train, vals) in runs.items():
        rows = [r for r in (vals if val else train) if key in r and x in r and r[key] is not None]
        if rows:
            ax.plot([r[x] for r in rows], [r[key] for r in rows], label=name + suffix, **kw)
            drawn = True
    return drawn


def plot(outs, to, names=None, dpi=110):
    """Write the PNGs of runs `outs` to folder `to`; `names` labels the runs (default: their
    folders' names)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(to, exist_ok=True)
    runs = dict(zip(names or _names(outs), (read_run(o) for o in outs)))
    # step 0 has only a val loss: give it 0 tokens, for the tokens axis
    for train, vals in runs.values():
        for r in vals:
            r.setdefault(
                "tokens",
                0
                if r["step"] == 0
                else next(
                    (t["tokens"] for t in train if t["step"] == r["step"] and "tokens" in t), None
                ),
            )
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, x in zip(axes, ("step", "tokens")):
        for val in (False, True):
            ax.set_prop_cycle(None)  # the same colour for a run's train and val curves
            _series(
                ax,
                runs,
                "val_loss" if val else "loss",
                x,
                val,
                " (val)" if val else "",
                linestyle="--" if val else "-",
                marker="o" if val else None,
                markersize=3,
                linewidth=1 if val else 1.2,
            )
        ax.set_xlabel(x if x == "step" else "tokens seen")
        ax.set_ylabel("loss (solid: train, dashed: validation)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    written.append(_save(fig, plt, to, "loss.png", dpi))

    panels = [
        ("tok_s", "tokens/s"),
        ("mfu", "MFU"),
        ("mem_gib", "memory (GiB)"),
        ("lr", "learning rate"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    for ax, (key, label) in zip(axes.flat, panels):
        if _series(ax, runs, key, marker=".", markersize=3, linewidth=0.8):
            ax.legend(fontsize=8)
        else:
            ax.text(
                0.5, 0.5, f"no run logged {key}", ha="center", va="center", transform=ax.transAxes
            )
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(_save(fig, plt, to, "throughput.png", dpi))

    for name, out in zip(runs, outs):
        traces = read_traces(out)
        if traces:
            path = os.path.join(to, f"timeline_{Path(name).name}.png")
            timeline.draw_timeline(traces, path)
            written.append(path)
    return written


def _save(fig, plt, to, name, dpi):
    path = os.path.join(to, name)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outs", nargs="+", help="train.py --out-dir folders (several: overlaid)")
    p.add_argument("--to", default=None, help="where to write the PNGs (default: FIRST_OUT/plots)")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "nanomega.tools.plot needs matplotlib: pip install 'nanomega[plot]'"
        ) from None
    for path in plot(args.outs, args.to or os.path.join(args.outs[0], "plots")):
        print(path)


def cli():
    """The console script (pyproject [project.scripts])."""
    lifecycle.entrypoint(main)  # bad input: one line, exit 2


if __name__ == "__main__":
    cli()
