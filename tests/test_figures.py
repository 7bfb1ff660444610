"""scripts/figures.py: the lessons and the README show exactly the figures the script makes (none
missing, none orphaned), and every run it trains passes train.py's up-front checks. File and flag
checks only: no training."""

import importlib.util
import re
from pathlib import Path

import pytest

from nanomega.job import checks, flags

ROOT = Path(__file__).resolve().parent.parent
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")


def load_script():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "scripts" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = load_script()


def referenced():
    """{figure file: [documents showing it]} for every PNG the lessons and the README embed."""
    refs = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "lessons").glob("*.md"))]:
        for link in IMAGE.findall(doc.read_text()):
            path = (doc.parent / link).resolve()
            assert path.parent == figures.FOLDER, (
                f"{doc.name} shows {link}, outside {figures.FOLDER}"
            )
            refs.setdefault(path.name, []).append(doc.name)
    return refs


def test_documents_show_exactly_the_scripts_figures():
    refs = referenced()
    made = set(figures.FIGURES) | set(figures.SCRIPTED)
    assert sorted(set(refs) - made) == [], "shown but not made by scripts/figures.py"
    assert sorted(made - set(refs)) == [], "made by scripts/figures.py but shown nowhere"
    on_disk = {p.name for p in figures.FOLDER.glob("*.png")}
    assert sorted(made - on_disk) == [], "not generated: run python scripts/figures.py"
    assert sorted(on_disk - made) == [], "orphaned PNGs in lessons/figures"
    for name in on_disk:  # committed PNGs, kept small (DPI): a broken or huge file fails here
        data = (figures.FOLDER / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 150_000, name


def test_the_reference_scan_can_fail(tmp_path):
    text = "![a](figures/x.png) and ![b](../lessons/figures/y.png)"
    assert IMAGE.findall(text) == ["figures/x.png", "../lessons/figures/y.png"]


def test_scripted_figures_come_from_a_lesson_script_with_a_figure_flag():
    for name, script in figures.SCRIPTED.items():
        assert "--figure" in (ROOT / script).read_text() and name not in figures.FIGURES, name


def test_every_figure_draws_runs_the_script_trains():
    for name, (runs, labels, kept) in figures.FIGURES.items():
        assert set(runs) <= set(figures.RUNS) and len(labels) == len(runs), name
        # only a pipeline run records a timeline (train.py, pp > 1)
        if kept.startswith("timeline_"):
            assert kept == f"timeline_{labels[0]}.png" and "--pp" in figures.RUNS[runs[0]][1], name
        else:
            assert kept in ("loss.png", "throughput.png"), name


@pytest.mark.parametrize("name", list(figures.RUNS))
def test_every_run_passes_train_checks(name, monkeypatch, tmp_path):
    world, _, _ = figures.RUNS[name]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    checks.check(flags.parse(figures.flags(name, tmp_path)))
