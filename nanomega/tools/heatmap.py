"""The search as a picture: the planner's MFU over tp x pp layouts (rows) and node counts (columns).

Idea: finding a configuration is three filters and a maximum, as the Ultra-Scale Playbook's
heatmaps of its 4,100 runs show them: a layout must fit in memory (tools/cost.py), reach the global
batch (dp x micro-batch divides it: tools/layouts.layout_error), and then run fastest. One cell is
the best MFU the planner finds for that (tp, pp) on that many nodes over the ZeRO stages
(layouts.plan pinned to tp and pp); an empty cell runs out of memory or cannot split the batch.
    cell(tp, pp, nodes) = max over zero of mfu(layout), layouts that fit only
    python -m nanomega.tools.heatmap --model llama3-70b --gpu h100-sxm --out mfu.png
Needs the `plot` extra (matplotlib) to draw; grid() alone does not.
Lesson: lessons/21-planning-a-run.md
"""

import argparse
from dataclasses import dataclass, replace

from nanomega.tools.cost import GPUS, MODELS, Run
from nanomega.tools.layouts import plan

LAYOUTS = [(tp, pp) for pp in (1, 2, 4, 8, 16) for tp in (1, 2, 4, 8)]
NODES = (1, 2, 4, 8, 16, 32, 64, 128)
# Llama 3 70B at 8,192 tokens, 4M-token batches, on H100 SXM: sdpa, selective recompute, overlap
LESSON = dict(model="llama3-70b", gpu="h100-sxm", nodes=NODES, layouts=LAYOUTS)
LESSON_RUN = Run(global_batch=512, attention="sdpa", overlap="overlap")


@dataclass(frozen=True)
class Grid:
    layouts: list  # [(tp, pp)], the rows
    nodes: tuple  # the columns
    mfu: list  # mfu[row][column]: the best fitting layout's MFU, or None
    best: list  # best[row][column]: that layout's Estimate, or None


def grid(model, gpu, run, nodes=NODES, layouts=LAYOUTS):
    """The planner's best fitting estimate per (tp, pp) and node count."""
    mfu, best = [], []
    for tp, pp in layouts:
        cells = []
        for n in nodes:
            fit = [e for e in plan(model, gpu, n * gpu.per_node, run, tp, pp) if e.fits]
            cells.append(max(fit, key=lambda e: e.mfu) if fit else None)
        best.append(cells)
        mfu.append([e.mfu if e else None for e in cells])
    return Grid(list(layouts), tuple(nodes), mfu, best)


def label(x):
    """A cell's text: MFU in whole percent, or nothing."""
    return "" if x is None else f"{x:.0%}"


def draw(g, path, title=""):
    """The heatmap as a PNG: one cell per (tp, pp) x nodes, annotated with label(MFU); returns
    the matplotlib figure (its texts are the cells' labels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [[float("nan") if x is None else x for x in row] for row in g.mfu]
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(g.nodes), 1.0 + 0.4 * len(g.layouts)))
    im = ax.imshow(values, cmap="viridis", aspect="auto", vmin=0)
    for i, row in enumerate(g.mfu):
        for j, x in enumerate(row):
            if x is not None:
                ax.text(j, i, label(x), ha="center", va="center", fontsize=8, color="white")
    ax.set_xticks(range(len(g.nodes)), [str(n) for n in g.nodes])
    ax.set_yticks(range(len(g.layouts)), [f"tp{t} pp{p}" for t, p in g.layouts])
    ax.set_xlabel("nodes of 8 GPUs")
    ax.set_ylabel("layout")
    ax.set_title(title or "predicted MFU (empty: does not fit or cannot split the batch)")
    fig.colorbar(im, ax=ax, label="MFU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def lesson_grid():
    """The lesson's figure's numbers."""
    return grid(MODELS[LESSON["model"]], GPUS[LESSON["gpu"]], LESSON_RUN)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m nanomega.tools.heatmap", description=__doc__)
    ap.add_argument("--model", default=LESSON["model"], choices=list(MODELS))
    ap.add_argument("--gpu", default=LESSON["gpu"], choices=list(GPUS))
    ap.add_argument("--global-batch", type=int, default=LESSON_RUN.global_batch)
    ap.add_argument("--nodes", type=int, nargs="+", default=list(NODES))
    ap.add_argument("--out", required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    if min(args.nodes) < 1 or args.global_batch < 1:
        raise SystemExit("heatmap: --nodes and --global-batch must be >= 1")
    run = replace(LESSON_RUN, global_batch=args.global_batch)
    g = grid(MODELS[args.model], GPUS[args.gpu], run, tuple(args.nodes))
    draw(g, args.out, f"{args.model} on {args.gpu}, batch {args.global_batch}: predicted MFU")
    print(f"heatmap: {args.out}")


if __name__ == "__main__":
    main()
