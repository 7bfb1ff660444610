"""scripts/renumber_lessons.py on a small copy of the lessons: files renamed to the reading order,
every kind of reference rewritten once (02 -> 04 is never read again as 04), a lesson ORDER does not
know sent to the end and named, and a second run changes nothing."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("renumber", ROOT / "scripts" / "renumber_lessons.py")
renumber = importlib.util.module_from_spec(spec)
spec.loader.exec_module(renumber)

# the old tree: 13 and 17 are read before 02 (ORDER), 21-new-idea is not in ORDER
FILES = {
    "lessons/00-overview.md": "# 00 — Overview: the three walls\n\n## Idea\nSee lesson 17.\n",
    "lessons/01-dense-model.md": "# 01 — The dense model\n\nlessons 13 and 02's bytes\n",
    "lessons/02-data-parallel-and-zero.md": (
        "# 02 — Data parallelism and ZeRO: the bytes\n\n"
        "> **You are here:** a stale line\n\n"
        "Read [lesson 17](17-collectives.md) first; `lessons/02_zero.py:main`;\n"
        "![zero](figures/02_zero_bytes.png); lessons 00-19 (a range).\n"
    ),
    "lessons/02_zero.py": '"""Lesson 02 experiment."""\n',
    "lessons/13-the-modern-block.md": "# 13 · The modern block\n\nafter lesson 01\n",
    "lessons/13_modern.py": '"""Lesson 13."""\nimport importlib\nimportlib.import_module("17_collectives")\n',
    "lessons/17-collectives.md": "# 17 — Collectives: what is sent\n\nLessons 02, 13 and 17.\n",
    "lessons/17_collectives.py": "def ring_all_reduce():\n    pass\n",
    "lessons/21-new-idea.md": "# 21 — A new idea\n\nafter lesson 02\n",
    "lessons/figures/02_zero_bytes.png": "not text: renamed only",
    "lessons/grade.py": 'E = {"ring": Exercise(\n    "17",\n    ("17_collectives:ring_all_reduce",),\n)}\n',
    "lessons/predict.py": 'P = {"ring-bytes": ("17", f), "zero": ("02", g)}\n',
    "lessons/README.md": (
        "| # | lesson |\n|---|---|\n"
        "| 00 | [Overview](00-overview.md) |\n| 02 | [DP](02-data-parallel-and-zero.md) |\n"
        "| 13 | [Modern](13-the-modern-block.md) |\n| 17 | [Collectives](17-collectives.md) |\n"
    ),
    "README.md": "[02](lessons/02-data-parallel-and-zero.md), [lesson 13](lessons/13-the-modern-block.md)\n",
    "nanomega/zero.py": '"""ZeRO.\n\nLesson: lessons/02-data-parallel-and-zero.md\n"""\n',
}


def tree(root):
    return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}


def test_renumber_rewrites_every_reference_once_and_is_idempotent(tmp_path, capsys):
    for rel, text in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    renumber.main(["--root", str(tmp_path), "--no-git"])
    printed = capsys.readouterr().out
    after = tree(tmp_path)

    # renamed: 13 -> 02, 17 -> 03, 02 -> 04 (scripts and figures with them), 21 (unknown) -> 05
    lessons = sorted(p for p in after if p.startswith("lessons/") and p[8:10].isdigit())
    assert lessons == [
        "lessons/00-overview.md",
        "lessons/01-dense-model.md",
        "lessons/02-the-modern-block.md",
        "lessons/02_modern.py",
        "lessons/03-collectives.md",
        "lessons/03_collectives.py",
        "lessons/04-data-parallel-and-zero.md",
        "lessons/04_zero.py",
        "lessons/05-new-idea.md",
    ]
    assert "lessons/figures/04_zero_bytes.png" in after
    assert "not in ORDER, sent to the end: new-idea" in printed
    assert "a range, not rewritten (edit by hand): lessons/04-data-parallel-and-zero.md" in printed

    # every kind of reference, rewritten once
    dp = after["lessons/04-data-parallel-and-zero.md"]
    assert dp.startswith(
        "# 04 — Data parallelism and ZeRO: the bytes\n\n> **You are here:** lesson 04"
    )
    assert "previous: [03 Collectives](03-collectives.md)" in dp
    assert "next: [05 A new idea](05-new-idea.md)" in dp and "a stale line" not in dp
    assert "Read [lesson 03](03-collectives.md) first; `lessons/04_zero.py:main`;" in dp
    assert "figures/04_zero_bytes.png" in dp and "lessons 00-19 (a range)" in dp
    assert "lessons 02 and 04's bytes" in after["lessons/01-dense-model.md"]
    assert "Lessons 04, 02 and 03." in after["lessons/03-collectives.md"]
    assert after["lessons/03-collectives.md"].startswith("# 03 — Collectives")
    assert after["lessons/02-the-modern-block.md"].startswith("# 02 · The modern block\n\n>")
    assert 'import_module("03_collectives")' in after["lessons/02_modern.py"]
    assert (
        'Exercise(\n    "03",\n    ("03_collectives:ring_all_reduce",)' in after["lessons/grade.py"]
    )
    assert '("03", f), "zero": ("04", g)' in after["lessons/predict.py"]
    assert after["README.md"] == (
        "[04](lessons/04-data-parallel-and-zero.md), [lesson 02](lessons/02-the-modern-block.md)\n"
    )
    assert "Lesson: lessons/04-data-parallel-and-zero.md" in after["nanomega/zero.py"]
    rows = [r for r in after["lessons/README.md"].splitlines() if r[2:4].isdigit()]
    assert rows == [
        "| 00 | [Overview](00-overview.md) |",
        "| 02 | [Modern](02-the-modern-block.md) |",
        "| 03 | [Collectives](03-collectives.md) |",
        "| 04 | [DP](04-data-parallel-and-zero.md) |",
    ]
    assert after["lessons/00-overview.md"].count("You are here") == 1
    assert "the first" in after["lessons/00-overview.md"]
    assert "the last" in after["lessons/05-new-idea.md"]

    # a second run: the map is the identity, nothing changes
    renumber.main(["--root", str(tmp_path), "--no-git"])
    assert tree(tmp_path) == after
