"""The capstone's rubric (lessons/23-capstone.md) run end to end at its smallest setting (N = 4 ranks:
one Llama-MoE run over dp 2 x cp 2, ep 2): every row OK and every check line the lesson shows printed
(the N = 4 ones); and a planted failure (the run is not the planned one) that the rubric catches with
the row that names it."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "23-capstone.md"
SCRIPT = ROOT / "lessons" / "23_capstone.py"


def grade(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_rubric_passes_end_to_end_and_prints_what_the_lesson_shows():
    out = grade()
    assert out.returncode == 0, f"rubric failed:\n{out.stdout[-4000:]}\n{out.stderr[-3000:]}"
    printed = out.stdout.splitlines()
    rows = [line for line in printed if line.startswith("check ")]
    assert len(rows) == 12 and all(line.endswith("-> OK") for line in rows), rows
    at_4 = LESSON.read_text().split("At N = 8")[0]  # the lesson quotes N = 4's output first
    quoted = re.findall(r"^(check .*)$", at_4, re.M)
    assert quoted and not [line for line in quoted if line not in printed]
    assert any(line.startswith("MFU ") and "the bubble" in line for line in printed)


def test_rubric_catches_a_run_that_is_not_the_planned_one():
    out = grade("--plant", "cp-method", "--parts", "train")
    assert out.returncode == 1, out.stdout[-3000:]
    assert re.search(r"^check cp wire bytes .* -> MISMATCH$", out.stdout, re.M), out.stdout[-3000:]
    assert "1 check(s) failed: cp wire bytes" in out.stdout
