"""The exercise grader (lessons/grade.py, run as `python lessons/check.py --exercise NAME FILE`) can
pass and fail.

Runs of check.py, as a student runs it: every solution passes every test its exercise names (one
run: the solutions' tests lie in three test modules, one spawned world each); every untouched
starter fails with its own NotImplementedError (in spawned ranks too: tp-fg's and flat's are raised
in the ranks, so the substitution reached them), and a 1F1B with a warm-up one forward too long
fails the op-order tests, all in one `--quick` run.
The predictions (lessons/predict.py): right answers RIGHT, a wrong bubble WRONG, a missing one
unanswered.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "lessons" / "exercises"
SOLUTIONS = {
    "tp-fg": "tp_fg.py",
    "vocab-ce": "vocab_ce.py",
    "1f1b": "one_f_one_b.py",
    "flat": "flat.py",
    "cp-merge": "cp_merge.py",
}
BUGGY_1F1B = """from nanomega.schedules import Op


def one_f_one_b(p, rank, m, v=1):
    warmup = min(p - rank, m)  # one forward too many in flight: the planted bug
    rounds = [[Op("F", i)] for i in range(warmup)]
    for i in range(m - warmup):
        rounds += [[Op("F", warmup + i)], [Op("B", i)]]
    return rounds + [[Op("B", i)] for i in range(m - warmup, m)]
"""

# the most common 1F1B bug: a warm-up of p - rank - 1 forwards even when there are fewer micro-batches
UNCAPPED_1F1B = """from nanomega.schedules import Op


def one_f_one_b(p, rank, m, v=1):
    warmup = p - rank - 1  # not capped at m: the planted bug
    rounds = [[Op("F", i)] for i in range(warmup)]
    for i in range(m - warmup):
        rounds += [[Op("F", warmup + i)], [Op("B", i)]]
    return rounds + [[Op("B", i)] for i in range(max(m - warmup, 0), m)]
"""

# a merge that averages the two parts instead of weighting each by its share of the union's sum
UNWEIGHTED_MERGE = """from nanomega.cp import positions, torch


def merge(acc, new):
    if acc is None:
        return new
    (o1, l1), (o2, l2) = acc, new
    return (o1 + o2) / 2, torch.logaddexp(l1, l2)  # the planted bug: no re-weighting
"""


def check(*args):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "lessons" / "check.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    verdicts = dict(re.findall(r"^exercise (\S+): \d+/\d+ tests pass -> (PASS|FAIL)$", out, re.M))
    return proc.returncode, verdicts, out


def pairs(folder, names):
    return [a for name in names for a in ("--exercise", name, str(folder / SOLUTIONS[name]))]


def test_every_solution_passes_its_tests():
    rc, verdicts, out = check(*pairs(EX / "solutions", SOLUTIONS))
    assert verdicts == dict.fromkeys(SOLUTIONS, "PASS") and rc == 0, out
    # every test ran, none skipped
    assert len(re.findall(r"^PASS ", out, re.M)) >= 9 + 9 + 12 + 16 + 9, out


def test_untouched_starters_and_a_planted_bug_fail(tmp_path):
    """One run (the suite's budget): the tp-fg and flat starters fail by their own
    NotImplementedError, raised in spawned ranks (the substitution reached them), and a 1F1B with
    one warm-up forward too many fails the op-order tests. The vocab-ce and 1f1b starters raise the
    same way in the pytest process itself."""
    buggy = tmp_path / "buggy_1f1b.py"
    buggy.write_text(BUGGY_1F1B)
    merge = tmp_path / "unweighted_merge.py"
    merge.write_text(UNWEIGHTED_MERGE)
    rc, verdicts, out = check(
        "--quick",
        *pairs(EX, ["tp-fg", "flat"]),
        *("--exercise", "1f1b", str(buggy), "--exercise", "cp-merge", str(merge)),
    )
    assert verdicts == dict.fromkeys(["tp-fg", "flat", "1f1b", "cp-merge"], "FAIL") and rc == 1, out
    assert re.search(r"^FAIL tests/test_cp_merge.py::.*merged output: \|got - want\|", out, re.M), (
        out
    )
    for name in ("tp-fg", "flat"):  # raised in a spawned rank: the substitution reached the ranks
        assert re.search(
            rf"^FAIL .*\(rank \d failed: NotImplementedError: exercise {name}:", out, re.M
        ), out
    assert re.search(
        r"^FAIL tests/test_pp.py::test_op_orders_literal .*(assert|Assertion)", out, re.M
    ), out


def test_a_file_without_the_names_is_one_line(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    rc, _, out = check("--exercise", "tp-fg", str(empty))
    assert rc == 2 and out.strip().splitlines() == [
        f"error: {empty} defines no 'CopyToTensorParallel': exercise tp-fg replaces "
        "nanomega.tp:CopyToTensorParallel; keep the starter's names"
    ], out
    rc, _, out = check("--exercise", "no-such", str(empty))
    assert rc == 2 and "choose one of tp-fg, vocab-ce, 1f1b, cp-merge, flat" in out, out


def test_predictions_graded_right_and_wrong(tmp_path):
    """One run: the solution's answers with one made wrong (the 1F1B bubble as (p-1)/m, idle over the
    ideal time: the common wrong convention) and one removed: the eleven others measured RIGHT, the wrong one
    WRONG, the missing one unanswered."""
    solution = (EX / "solutions" / "predictions.py").read_text()
    # the untouched starter answers nothing
    assert (EX / "predictions.py").read_text().count(": None,") == 13
    wrong = tmp_path / "wrong.py"
    wrong.write_text(
        solution.replace("(p - 1) / (12 + p - 1),", "(p - 1) / 12,").replace(
            '"gpipe-in-flight": m,', '"gpipe-in-flight": None,'
        )
    )
    rc, _, out = check("--predict", str(wrong))
    assert (
        rc == 1 and "predict 1f1b-bubble (lesson 05): yours 0.25, measured 0.2 -> WRONG" in out
    ), out
    assert out.count("-> RIGHT") == 11 and out.count("no prediction yet") == 1, out
    assert "predictions: 11/13 right" in out, out


def test_quick_catches_an_uncapped_warmup_and_prints_the_case(tmp_path):
    """`--quick` runs one test: it must hold a case with fewer micro-batches than stages, and the
    failure line names the case (p, rank, m) and both orders."""
    buggy = tmp_path / "uncapped_1f1b.py"
    buggy.write_text(UNCAPPED_1F1B)
    rc, verdicts, out = check("--quick", "--exercise", "1f1b", str(buggy))
    assert verdicts == {"1f1b": "FAIL"} and rc == 1, out
    assert re.search(
        r"^FAIL tests/test_pp.py::test_op_orders_literal .*1f1b p=4 rank=0 m=2: got \S+, want F0F1B0B1",
        out,
        re.M,
    ), out
