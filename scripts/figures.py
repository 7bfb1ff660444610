"""Every figure the lessons and the README show, from real runs: `python scripts/figures.py` trains
the small runs below on this machine's CPU, draws them with nanomega.tools.plot and writes
lessons/figures/*.png (the ones committed).

    python scripts/figures.py            # all runs, then all figures (~3.5 min on 2 shared cores)
    python scripts/figures.py --keep DIR # keep the runs' out-dirs in DIR (default: a temporary folder, removed)
    python scripts/figures.py 11_memory_recompute.png   # only these figures (and only the runs they draw)

RUNS are train.py command lines; FIGURES say which runs each picture overlays and which of
nanomega.tools.plot's files (loss.png, throughput.png, timeline_<run>.png) it keeps, under which
name; SCRIPTED: figures a lesson's experiment draws. tests/test_figures.py checks that the lessons
and the README reference exactly these files and that every run's flags pass train.py's checks.
Timings in the throughput panels are this CPU's (the script prints which one): read them next to it.
Needs the `plot` extra (matplotlib).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanomega import extension, worlds  # noqa: E402

FOLDER = ROOT / "lessons" / "figures"
DPI = 72  # a few tens of KB per PNG, still readable on GitHub

# The README's run: its default model (L=4, h=128, s=128), global batch 16 = 4 x 4 micro-batches,
# 100 steps.
README = [
    "--batch-size",
    "4",
    "--grad-accum",
    "4",
    "--max-steps",
    "100",
    "--eval-every",
    "20",
    "--peak-flops",
    "1.6e11",
]
# A tiny model for curves that must coincide (layouts, precisions): 60 steps in seconds.
TINY = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "64",
    "--block-size",
    "64",
    "--batch-size",
    "2",
    "--grad-accum",
    "4",
    "--max-steps",
    "40",
    "--warmup",
    "8",
    "--eval-every",
    "8",
    "--eval-iters",
    "4",
    "--peak-flops",
    "1.6e11",
]
# The precision runs: TINY at h = 256, wide enough that a bf16 matmul runs on AVX512-BF16
# instructions where the CPU has them (a 256^2 bf16 matmul ~2x fp32's rate on the AMD EPYC this was
# drawn on; at h = 64 bf16 is slower).
PRECISION = [*TINY, "--n-embd", "256", "--n-head", "4"]
# Large activations (s = 512, b = 8; eager attention keeps its (b, a, s, s) scores, which selective
# recompute drops) so recompute's saving shows in the process's peak RSS; a few steps.
ACTIVATIONS = [
    "--block-size",
    "512",
    "--batch-size",
    "8",
    "--attention",
    "eager",
    "--max-steps",
    "5",
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--peak-flops",
    "1.6e11",
]

# name: (world size, flags, fresh) -- fresh: a process of its own, so the peak RSS it logs is its
# own alone
RUNS = {
    "readme-dense": (1, README, False),
    "readme-pp2-1f1b": (2, [*README, "--pp", "2"], False),
    "pp2-gpipe": (
        2,
        [*README, "--pp", "2", "--schedule", "gpipe", "--max-steps", "2", "--eval-every", "0"],
        False,
    ),
    "tiny-fp32": (1, TINY, False),
    "prec-fp32": (1, PRECISION, False),
    "prec-bf16": (1, [*PRECISION, "--dtype", "bf16"], False),
    "prec-fp16": (1, [*PRECISION, "--dtype", "fp16"], False),
    "tiny-dp2-zero1": (2, [*TINY, "--zero", "1", "--batch-size", "1"], False),
    "tiny-tp2-sp": (2, [*TINY, "--tp", "2", "--sequence-parallel"], False),
    "tiny-pp2-1f1b": (2, [*TINY, "--pp", "2"], False),
    "recompute-none": (1, ACTIVATIONS, True),
    "recompute-selective": (1, [*ACTIVATIONS, "--recompute", "selective"], True),
    "recompute-full": (1, [*ACTIVATIONS, "--recompute", "full"], True),
}

# figure file: (runs overlaid, their labels, the nanomega.tools.plot file kept)
FIGURES = {
    "readme_loss.png": (["readme-dense", "readme-pp2-1f1b"], ["dense", "pp2-1f1b"], "loss.png"),
    "readme_throughput.png": (
        ["readme-dense", "readme-pp2-1f1b"],
        ["dense", "pp2-1f1b"],
        "throughput.png",
    ),
    "08_timeline_pp2-1f1b.png": (["readme-pp2-1f1b"], ["pp2-1f1b"], "timeline_pp2-1f1b.png"),
    "08_timeline_pp2-gpipe.png": (["pp2-gpipe"], ["pp2-gpipe"], "timeline_pp2-gpipe.png"),
    "09_loss_precision.png": (
        ["prec-fp32", "prec-bf16", "prec-fp16"],
        ["fp32", "bf16", "fp16"],
        "loss.png",
    ),
    "09_throughput_precision.png": (
        ["prec-fp32", "prec-bf16", "prec-fp16"],
        ["fp32", "bf16", "fp16"],
        "throughput.png",
    ),
    "11_memory_recompute.png": (
        ["recompute-none", "recompute-selective", "recompute-full"],
        ["none", "selective", "full"],
        "throughput.png",
    ),
    "15_loss_layouts.png": (
        ["tiny-fp32", "tiny-dp2-zero1", "tiny-tp2-sp", "tiny-pp2-1f1b"],
        ["dense", "dp2-zero1", "tp2-sp", "pp2-1f1b"],
        "loss.png",
    ),
}

# figures a lesson's own experiment draws (`python SCRIPT --figure PATH`), not from training runs
SCRIPTED = {
    "21_mfu_heatmap.png": "lessons/21_plan.py",
    "16_expert_loads.png": "lessons/16_experts.py",
    # 1-bit Adam against AdamW: four dp runs of README's model, 200 steps each (~1 hour on 2 cores)
    "18_loss_onebit.png": "bench/onebit_convergence.py",
    # ZeRO++ against plain ZeRO-3: five 4-rank runs of README's model, 100 steps (~40 min on 2 cores)
    "17_loss_zeropp.png": "bench/zeropp_convergence.py",
    # the pictures of the ideas: drawn from the code that does them, no run needed
    "diagram_compose.png": "lessons/diagrams.py",
    "diagram_grid.png": "lessons/diagrams.py",
    "diagram_plan.png": "lessons/diagrams.py",
    "diagram_capstone.png": "lessons/diagrams.py",
    "diagram_ring.png": "lessons/diagrams.py",
    "diagram_zero.png": "lessons/diagrams.py",
    "diagram_tp.png": "lessons/diagrams.py",
    "diagram_1f1b.png": "lessons/diagrams.py",
    "08_timeline_zb-h1_unit_clock.png": "lessons/diagrams.py",
    "08_timeline_zb-h2_unit_clock.png": "lessons/diagrams.py",
    "08_timeline_dualpipev_unit_clock.png": "lessons/diagrams.py",
    "08_timeline_zb-v_unit_clock.png": "lessons/diagrams.py",
    "diagram_sp.png": "lessons/diagrams.py",
    "diagram_cp.png": "lessons/diagrams.py",
    "diagram_reshard.png": "lessons/diagrams.py",
    "diagram_flash.png": "lessons/diagrams.py",
    "diagram_gqa.png": "lessons/diagrams.py",
    "diagram_fused.png": "lessons/diagrams.py",
    "diagram_young.png": "lessons/diagrams.py",
    "diagram_chinchilla.png": "lessons/diagrams.py",
    "diagram_allocations.png": "lessons/diagrams.py",
    "diagram_moe.png": "lessons/diagrams.py",
    "diagram_fp8.png": "lessons/diagrams.py",
    "diagram_recompute.png": "lessons/diagrams.py",
    "diagram_spacing.png": "lessons/diagrams.py",
    "diagram_flops.png": "lessons/diagrams.py",
    "diagram_zeropp.png": "lessons/diagrams.py",
    "diagram_onebit.png": "lessons/diagrams.py",
}


def flags(name, root):
    """train.py's command line of run `name`, its out-dir under root; one token cache shared by all
    runs."""
    return [
        *RUNS[name][1],
        "--out-dir",
        str(Path(root) / name),
        "--data-cache",
        str(Path(root) / "cache"),
    ]


def _train(root, names):
    from nanomega import train

    for name in names:
        train.main(flags(name, root))
    return True


def train_all(root, names):
    """The runs `names`, one spawned world per world size (one torch start-up each), fresh runs in
    worlds of their own."""
    shared = {}
    for name in names:
        world, _, fresh = RUNS[name]
        if fresh:
            worlds.launch(_train, world, root, [name], timeout=600)
        else:
            shared.setdefault(world, []).append(name)
    for world, names in sorted(shared.items()):
        worlds.launch(_train, world, root, names, timeout=1200)


def draw(root, figures, folder=FOLDER):
    from nanomega.tools import plot

    folder.mkdir(parents=True, exist_ok=True)
    for figure in figures:
        runs, labels, kept = FIGURES[figure]
        scratch = Path(root) / "plots" / figure
        plot.plot([Path(root) / r for r in runs], scratch, names=labels, dpi=DPI)
        shutil.copyfile(scratch / kept, folder / figure)
        print(f"{folder / figure}  ({(folder / figure).stat().st_size / 1024:.0f} KiB)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "figures", nargs="*", help=f"only these (default: all): {', '.join([*FIGURES, *SCRIPTED])}"
    )
    p.add_argument(
        "--keep", default=None, help="keep the runs' out-dirs here (default: a temporary folder)"
    )
    args = p.parse_args(argv)
    unknown = sorted(set(args.figures) - set(FIGURES) - set(SCRIPTED))
    if unknown:
        sys.exit(
            f"scripts/figures.py: no figure {', '.join(unknown)}; choose from {', '.join([*FIGURES, *SCRIPTED])}"
        )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("scripts/figures.py needs matplotlib: pip install 'nanomega[plot]'")
    root = Path(args.keep or tempfile.mkdtemp(prefix="figures-"))
    chosen = args.figures or [*FIGURES, *SCRIPTED]
    figures, scripted = [f for f in chosen if f in FIGURES], [f for f in chosen if f in SCRIPTED]
    runs = [name for name in RUNS if any(name in FIGURES[f][0] for f in figures)]
    t0 = time.time()
    try:
        train_all(root, runs)
        draw(root, figures)
        for figure in scripted:
            subprocess.run(
                [sys.executable, str(ROOT / SCRIPTED[figure]), "--figure", str(FOLDER / figure)],
                check=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"{len(figures) + len(scripted)} figures ({len(runs)} runs) in {time.time() - t0:.0f} s on "
        f"{extension.cpu_summary()}, {os.cpu_count()} cores"
    )


if __name__ == "__main__":
    main()
