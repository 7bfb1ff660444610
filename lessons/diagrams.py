"""Pictures of the ideas, drawn from the code that does them, so that they cannot drift from it.

Each diagram is two functions: one computes what the picture shows by calling nanomega (or running
the lesson's own algorithm), the other draws it. tests/test_diagrams.py holds each computed picture
against the rule the lesson states (a ring's chunk after n - 1 steps, ZeRO's bytes per parameter, the
causal tiles, ...); scripts/figures.py redraws them all:
    python lessons/diagrams.py --figure lessons/figures/diagram_ring.png   # one diagram
    python lessons/diagrams.py                                             # all of them
Needs the `plot` extra (matplotlib) to draw; the data functions need only torch.
"""

import argparse
import ast
import os
import queue
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "lessons"))

from nanomega import cp, dist, flat, schedules, timeline, tp, zero_rules  # noqa: E402

FOLDER = ROOT / "lessons" / "figures"
DPI = 72


# ---------------------------------------------------------------------------------------------------
# what each picture shows, computed


class ThreadRing:
    """The slice of dist.Axis that lesson 17's ring all-reduce uses (size, rank, p2p), for n threads
    standing in for n ranks: a send is put in the receiver's queue, a receive takes from its own."""

    def __init__(self, rank, boxes):
        self.rank, self.size, self.boxes = rank, len(boxes), boxes

    def p2p(self, sends, recvs):
        for tensor, peer in sends:
            self.boxes[peer].put(tensor)
        for buf, _ in recvs:
            buf.copy_(self.boxes[self.rank].get(timeout=10))


def lesson_script(name):
    """A lesson's script as a module, by path (its name starts with a digit); its experiment runs
    under __main__ only, so loading it runs nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "lessons" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_threads(n, rank_main):
    """rank_main(rank) on n threads at once, joined."""
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def ring_steps(n=4):
    """Lesson 17's ring all-reduce run on n threads, each chunk tagged so that what travels can be
    read: element 0 of rank r's chunk c is 2^r (a sum of them names the ranks it holds), element 1
    is c (a sum of k of them is k c). Returns [(step, rank, chunk, ranks summed in it)] of every
    send, in the order the ranks sent them."""
    lesson = lesson_script("17_collectives.py")
    boxes, sent = [queue.Queue() for _ in range(n)], []
    lock = threading.Lock()

    class Recording(ThreadRing):
        def p2p(self, sends, recvs):
            with lock:
                step = sum(1 for s in sent if s[1] == self.rank)
                for tensor, _ in sends:
                    mask, k_times_c = int(tensor[0]), int(tensor[1])
                    ranks = tuple(r for r in range(n) if mask >> r & 1)
                    sent.append((step, self.rank, k_times_c // len(ranks), ranks))
            super().p2p(sends, recvs)

    def rank_main(r):
        x = torch.tensor([[2.0**r, c] for c in range(n)], dtype=torch.float64).flatten()
        lesson.ring_all_reduce(Recording(r, boxes), x)

    on_threads(n, rank_main)
    return sorted(sent)


def zero_memory(n=4):
    """{stage: (weights, gradients, optimizer) bytes per parameter on one of n ranks}, from
    zero_rules.STAGE: bf16 weights 2, fp32 gradients 4, Adam's fp32 master, m and v 12."""
    return {
        stage: (
            2 / (n if rule.parameters else 1),
            4 / (n if rule.gradients else 1),
            12 / (n if rule.optimizer else 1),
        )
        for stage, rule in zero_rules.STAGE.items()
    }


def tp_owners(h=8, t=2):
    """Which tp rank holds each element of the MLP's two matrices, from tp.shard_param: the first
    split by output rows (column-parallel), the second by input columns (row-parallel)."""
    owners = {}
    for name, shape in (
        ("blocks.0.mlp.c_fc.weight", (4 * h, h)),
        ("blocks.0.mlp.c_proj.weight", (h, 4 * h)),
    ):
        full = torch.full(shape, -1)
        for rank in range(t):
            tp.shard_param(name, full, rank, t).fill_(rank)  # a view into full
        owners[name] = full
    return owners


class TracingAxis:
    """A tensor-parallel axis of `size` ranks seen from rank 0 alone: each collective is recorded
    as (op, input shape, output shape) and returns a tensor of the right shape (values are not the
    real sums: only the shapes and the order are drawn)."""

    def __init__(self, size=2):
        self.name, self.size, self.rank, self.trace = "tp", size, 0, []

    def all_reduce(self, t, op=None):
        self.trace.append(("all_reduce", tuple(t.shape), tuple(t.shape)))
        return t

    def all_gather(self, out, t):
        self.trace.append(("all_gather", tuple(t.shape), tuple(out.shape)))
        return out.copy_(torch.cat([t] * self.size))

    def reduce_scatter(self, out, t):
        self.trace.append(("reduce_scatter", tuple(t.shape), tuple(out.shape)))
        return out.copy_(t[: out.shape[0]])

    def start(self, op, out, t=None):  # the overlapped form: done at once, no Work to wait on
        getattr(self, op)(*((out, t) if t is not None else (out,)))


def sp_trace(n_layer=2, t=2, b=2, s=16, h=32):
    """The collectives of one forward of a GPT under tp + sequence parallelism, in order, from
    tp.apply_tensor_parallel's modules run on a TracingAxis: [(op, input shape, output shape)]."""
    from nanomega.gpt_config import GPTConfig
    from nanomega.model import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=s, n_layer=n_layer, n_head=4, n_embd=h))
    axis = TracingAxis(t)
    tp.apply_tensor_parallel(model, axis, sequence_parallel=True)
    x = torch.randint(256, (b, s))
    model(x, x)
    return axis.trace


RESHARD_PARAMS = (("wte", 24), ("ln.w", 6), ("attn.w", 30), ("mlp.w", 20))  # names, element counts


def shard_pieces(n):
    """{rank: [(name, start, end)]}: the elements of each parameter rank r owns when the flat
    buffer of RESHARD_PARAMS is split over n ranks (flat.FlatGroup.pieces, turned into the
    parameter's own coordinates, the (name, start, end) a checkpoint saves)."""
    named = [(name, torch.zeros(size)) for name, size in RESHARD_PARAMS]
    owned = {}
    for rank in range(n):
        group = flat.FlatGroup(named, n, rank, split=True, keep="shard")
        offsets = dict(zip(group.names, group.offsets))
        owned[rank] = [
            (group.names[i], a - offsets[group.names[i]], b - offsets[group.names[i]])
            for i, a, b in group.pieces()
        ]
    return owned


STEPS = ("apply_", "build_stage", "cast_model", "materialize", "ZeroEngine")  # what composes


def compose_order():
    """The techniques nanomega/compose.py:build applies, in its source order: each call of a
    module's apply_*, pp.build_stage, precision.cast_model, meta.materialize and zero.ZeroEngine,
    read from the code itself (ast), as "module.function"."""
    tree = ast.parse((ROOT / "nanomega" / "compose.py").read_text())
    build = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build")
    calls = [
        n
        for n in ast.walk(build)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.attr.startswith(STEPS)
    ]
    return [
        f"{c.func.value.id}.{c.func.attr}"
        for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))
    ]


def cp_chunks(s=16, n=4):
    """{rank: its token positions} for context parallelism over n ranks (cp.positions), and each
    rank's causal work in (chunk, chunk) pairs."""
    held = {rank: cp.positions(s, n, rank).tolist() for rank in range(n)}
    work = {rank: sum(q >= k for q in held[rank] for k in range(s)) for rank in range(n)}
    return held, work


def causal_tiles(s=8 * 32, block=32):
    """The (query tile, key tile) pairs a causal FlashAttention computes: on and below the diagonal."""
    t = s // block
    return [(i, j) for i in range(t) for j in range(t) if j <= i], t


def gqa_groups(n_head=8, n_kv=2):
    """Which key/value head each query head reads: model.py's repeat_interleave of the kv heads."""
    kv = torch.arange(n_kv).view(1, n_kv, 1, 1)
    return kv.repeat_interleave(n_head // n_kv, dim=1).flatten().tolist()


def grid_groups(dp=2, pp=2, tp=4):
    """{rank: (dp, pp, tp) coordinates} and the tp, pp and dp groups of a 3D layout, from
    dist.layout: tp fastest (neighbours inside a node), then pp, dp outermost."""
    groups = {
        axis: [g.tolist() for g in dist.layout(dp=dp, pp=pp, tp=tp)[axis]]
        for axis in ("tp", "pp", "dp")
    }
    coords = {}
    for axis in ("dp", "pp", "tp"):
        for group in groups[axis]:
            for index, rank in enumerate(group):
                coords.setdefault(rank, {})[axis] = index
    return {r: (c["dp"], c["pp"], c["tp"]) for r, c in sorted(coords.items())}, groups


# ---------------------------------------------------------------------------------------------------
# drawing


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_ring(path):
    plt = _plt()
    n, sends = 4, ring_steps(4)
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = plt.get_cmap("tab10")
    for step, rank, chunk, ranks in sends:
        ax.add_patch(
            plt.Rectangle((step, n - 1 - rank), 0.95, 0.9, color=colours(chunk), alpha=0.35)
        )
        label = f"c{chunk}\n" + "+".join(map(str, ranks))
        ax.text(step + 0.47, n - 0.55 - rank, label, ha="center", va="center", fontsize=8)
    ax.axvline(n - 1 - 0.025, color="k", lw=1)
    ax.set_xlim(0, 2 * (n - 1))
    ax.set_ylim(0, n)
    ax.set_yticks([n - 0.55 - r for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_xticks([s + 0.47 for s in range(2 * (n - 1))], [f"{s + 1}" for s in range(2 * (n - 1))])
    ax.set_xlabel("step: reduce-scatter (left of the line), then all-gather; each rank sends right")
    ax.set_title(
        "Ring all-reduce, 4 ranks: the chunk each rank sends (c) and the ranks summed in it"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_zero(path):
    plt = _plt()
    n, memory = 4, zero_memory(4)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    parts = ("bf16 weights", "fp32 gradients", "Adam state (fp32 master, m, v)")
    left = [0.0] * len(memory)
    for i, part in enumerate(parts):
        widths = [memory[s][i] for s in memory]
        ax.barh([f"ZeRO-{s}" for s in memory], widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    for y, total in enumerate(left):
        ax.text(total + 0.2, y, f"{total:g} B", va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, 21)
    ax.set_xlabel(f"bytes per parameter on one of N = {n} data-parallel ranks (zero_rules.STAGE)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_tp(path):
    plt = _plt()
    owners = tp_owners()
    fig, axes = plt.subplots(1, 2, figsize=(7, 3.6))
    titles = (
        "c_fc (4h, h): column-parallel,\nsplit by output rows; f before it",
        "c_proj (h, 4h): row-parallel,\nsplit by input columns; g after it",
    )
    for ax, grid, title in zip(axes, owners.values(), titles):
        ax.imshow(grid.numpy(), cmap="Pastel1", vmin=0, vmax=8, aspect="auto")
        for rank in grid.unique().tolist():  # each rank's name at the middle of its block
            rows, cols = (grid == rank).nonzero(as_tuple=True)
            ax.text(
                cols.float().mean().item(), rows.float().mean().item(), f"rank {rank}", ha="center"
            )
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(
        "Megatron's MLP over tp = 2: which rank holds each weight (tp.shard_param)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_1f1b(path):
    traces = schedules.simulate(4, 8, "1f1b")
    timeline.draw_timeline(traces, path)


def draw_sp(path):
    plt = _plt()
    trace = sp_trace(n_layer=1)
    fig, ax = plt.subplots(figsize=(9, 2.2))
    names = {
        "all_gather": "all-gather",
        "reduce_scatter": "reduce-scatter",
        "all_reduce": "all-reduce",
    }
    where = [
        "embedding\n(vocab split)",
        "attention\n(heads split)",
        "MLP\n(cols, rows)",
        "LM head",
    ]
    x, region = 0.0, 0
    for op, *_ in trace:
        if op == "all_reduce":  # the loss's few floats (lesson 03), not an activation
            continue
        # the region before the collective: sequence-split after a reduce-scatter
        split = op == "all_gather"
        colour = "tab:green" if split else "tab:blue"
        label = "LN, dropout,\nresidual\n(b, s/t, h)" if split else where[min(region, 3)]
        ax.add_patch(plt.Rectangle((x, 0.3), 1.6, 0.5, color=colour, alpha=0.3))
        ax.text(x + 0.8, 0.55, label, ha="center", va="center", fontsize=7)
        ax.annotate(names[op], (x + 1.6, 0.85), ha="center", fontsize=7, color="k")
        region += not split
        x += 1.8
    ax.add_patch(plt.Rectangle((x, 0.3), 1.6, 0.5, color="tab:blue", alpha=0.3))
    ax.text(x + 0.8, 0.55, where[3], ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.1, x + 1.8)
    ax.set_ylim(0.1, 1.0)
    ax.axis("off")
    ax.set_title(
        "One layer's forward under tp + SP (tp.py's modules, traced): green holds 1/t of the tokens, "
        "blue all of them",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_reshard(path):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 2.6))
    colours = plt.get_cmap("tab10")
    sizes = [size for _, size in RESHARD_PARAMS]
    offset = {name: sum(sizes[:i]) for i, (name, _) in enumerate(RESHARD_PARAMS)}
    total = sum(sizes)
    for row, n in enumerate((4, 2)):
        y = 1 - row
        for rank, pieces in shard_pieces(n).items():
            for i, (name, a, b) in enumerate(pieces):
                colour = colours([p for p, _ in RESHARD_PARAMS].index(name))
                ax.add_patch(
                    plt.Rectangle((offset[name] + a, y + 0.15), b - a, 0.6, color=colour, alpha=0.5)
                )
                if i == 0:
                    ax.text(offset[name] + a + 0.5, y + 0.82, f"rank {rank}", fontsize=7)
            lo = rank * -(-total // n)  # rank r owns [r S, (r + 1) S), S = ceil(total / n)
            ax.axvline(lo, ymin=(y + 0.1) / 2, ymax=(y + 0.9) / 2, color="k", lw=1)
        ax.text(-1, y + 0.45, f"N = {n}", ha="right", va="center", fontsize=9)
    for name, size in RESHARD_PARAMS:
        ax.text(offset[name] + size / 2, 0.02, name, ha="center", fontsize=8)
    ax.set_xlim(-8, total + 2)
    ax.set_ylim(0, 2)
    ax.axis("off")
    ax.set_title(
        "One flat buffer split over 4 and over 2 ranks (flat.FlatGroup): a checkpoint saves each "
        "piece as (name, start, end),\nso a run at N = 2 reads what N = 4 wrote by name",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_compose(path):
    plt = _plt()
    steps = compose_order()
    fig, ax = plt.subplots(figsize=(4.2, 0.45 * len(steps) + 0.8))
    for i, step in enumerate(steps):
        y = len(steps) - 1 - i
        ax.add_patch(plt.Rectangle((0, y + 0.1), 1, 0.7, color="tab:blue", alpha=0.25))
        ax.text(0.5, y + 0.45, step, ha="center", va="center", fontsize=8)
        if i:
            ax.annotate("", (0.5, y + 0.8), (0.5, y + 1.1), arrowprops=dict(arrowstyle="->"))
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(0, len(steps))
    ax.axis("off")
    ax.set_title(
        "compose.build: one rank's model, in this order\n(read from its source)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_zb_h1(path):
    # the paper's unit setting: F, B (input gradient) and W (weight gradients) one unit each
    timeline.draw_timeline(schedules.simulate(4, 8, "zb-h1", t_f=1, t_b=1, t_w=1), path)


def draw_cp(path):
    plt = _plt()
    s, n = 16, 4
    held, work = cp_chunks(s, n)
    fig, ax = plt.subplots(figsize=(7, 3))
    colours = plt.get_cmap("tab10")
    for rank, positions in held.items():
        for pos in positions:
            ax.add_patch(
                plt.Rectangle((pos, n - 1 - rank), 0.95, 0.9, color=colours(rank), alpha=0.5)
            )
        ax.text(s + 0.3, n - 0.55 - rank, f"{work[rank]} (q, k) pairs", va="center", fontsize=9)
    ax.set_xlim(0, s + 4)
    ax.set_ylim(0, n)
    ax.set_yticks([n - 0.55 - r for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_xticks(range(0, s, 2))
    ax.set_xlabel(
        "token position; each rank holds a head chunk and its mirror tail chunk (cp.positions)"
    )
    ax.set_title(f"Context parallelism, cp = {n}, s = {s}: equal causal work per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_flash(path):
    plt = _plt()
    computed, t = causal_tiles()
    fig, ax = plt.subplots(figsize=(4, 4))
    for i in range(t):
        for j in range(t):
            done = (i, j) in computed
            ax.add_patch(
                plt.Rectangle((j, t - 1 - i), 0.95, 0.95, color="tab:blue" if done else "0.9")
            )
    ax.set_xlim(0, t)
    ax.set_ylim(0, t)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel("key tiles")
    ax.set_ylabel("query tiles")
    ax.set_title(f"Causal tiles, T = {t}: {len(computed)} of {t * t} computed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_gqa(path):
    plt = _plt()
    groups = gqa_groups()
    n_head, n_kv = len(groups), max(groups) + 1
    fig, ax = plt.subplots(figsize=(6, 2.4))
    for h, g in enumerate(groups):
        ax.plot([h, g * n_head / n_kv + (n_head / n_kv - 1) / 2], [1, 0], color="0.5")
    ax.scatter(range(n_head), [1] * n_head, s=300, color="tab:blue", zorder=3)
    ax.scatter(
        [g * n_head / n_kv + (n_head / n_kv - 1) / 2 for g in range(n_kv)],
        [0] * n_kv,
        s=300,
        color="tab:orange",
        zorder=3,
    )
    ax.set_yticks([0, 1], ["k/v heads", "query heads"])
    ax.set_xticks([])
    ax.set_ylim(-0.4, 1.4)
    ax.set_title(
        f"Grouped-query attention: {n_head} query heads read {n_kv} key/value heads", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_grid(path):
    plt = _plt()
    coords, groups = grid_groups()
    fig, ax = plt.subplots(figsize=(7.5, 3))
    colours = plt.get_cmap("tab10")
    per_node = 8
    for rank, (d, p, t) in coords.items():
        x, y = rank % per_node, 1 - rank // per_node
        ax.add_patch(
            plt.Rectangle((x + 0.05, y + 0.1), 0.9, 0.8, color=colours(2 * d + p), alpha=0.35)
        )
        ax.text(
            x + 0.5,
            y + 0.5,
            f"rank {rank}\ndp{d} pp{p} tp{t}",
            ha="center",
            va="center",
            fontsize=8,
        )
    for node in range(len(coords) // per_node):
        ax.add_patch(plt.Rectangle((0, 1 - node), per_node, 1, fill=False, lw=2))
        ax.text(per_node + 0.1, 1.5 - node, f"node {node}", va="center", fontsize=9)
    ax.set_xlim(0, per_node + 1.2)
    ax.set_ylim(0, 2)
    ax.axis("off")
    ax.set_title(
        "dp 2 x pp 2 x tp 4 on two 8-GPU nodes (dist.layout): a colour is one (dp, pp) tp group of 4 "
        "neighbours;\npp pairs sit in one node, dp replicas across nodes",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


DIAGRAMS = {
    "diagram_compose.png": draw_compose,
    "diagram_grid.png": draw_grid,
    "diagram_ring.png": draw_ring,
    "diagram_zero.png": draw_zero,
    "diagram_tp.png": draw_tp,
    "diagram_1f1b.png": draw_1f1b,
    "05_timeline_zb-h1_unit_clock.png": draw_zb_h1,
    "diagram_sp.png": draw_sp,
    "diagram_cp.png": draw_cp,
    "diagram_reshard.png": draw_reshard,
    "diagram_flash.png": draw_flash,
    "diagram_gqa.png": draw_gqa,
}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="draw the lessons' diagrams into lessons/figures/")
    p.add_argument("--figure", default=None, help="one diagram's path (default: all of them)")
    args = p.parse_args()
    paths = [Path(args.figure)] if args.figure else [FOLDER / name for name in DIAGRAMS]
    for path in paths:
        if path.name not in DIAGRAMS:
            sys.exit(
                f"lessons/diagrams.py: no diagram {path.name}; choose from {', '.join(DIAGRAMS)}"
            )
        DIAGRAMS[path.name](os.fspath(path))
        print(f"wrote {path}")
