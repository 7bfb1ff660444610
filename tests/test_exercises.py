"""The exercise grader (lessons/grade.py, run as `python lessons/check.py --exercise NAME FILE`) can pass and fail.

Runs of check.py, as a student runs it: every solution passes every test its exercise names (one run: the
solutions' tests lie in three test modules, one spawned world each); every untouched starter fails with its own
NotImplementedError (in spawned ranks too: tp-fg's and flat's are raised in the ranks, so the substitution reached
them), and a 1F1B with a warm-up one forward too long fails the op-order tests. Starters run on each exercise's
`quick` test: exercises whose tests lie in different modules share a run, each failure naming its exercise.
The predictions (lessons/predict.py): the solution's are all RIGHT, the starter's are unanswered, a wrong
bubble is WRONG.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "lessons" / "exercises"
SOLUTIONS = {"tp-fg": "tp_fg.py", "vocab-ce": "vocab_ce.py", "1f1b": "one_f_one_b.py", "flat": "flat.py"}
BUGGY_1F1B = '''from nanomega.schedules import Op


def one_f_one_b(p, rank, m, v=1):
    warmup = min(p - rank, m)  # one forward too many in flight: the planted bug
    rounds = [[Op("F", i)] for i in range(warmup)]
    for i in range(m - warmup):
        rounds += [[Op("F", warmup + i)], [Op("B", i)]]
    return rounds + [[Op("B", i)] for i in range(m - warmup, m)]
'''


def check(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "lessons" / "check.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    verdicts = dict(re.findall(r"^exercise (\S+): \d+/\d+ tests pass -> (PASS|FAIL)$", out, re.M))
    return proc.returncode, verdicts, out


def pairs(folder, names):
    return [a for name in names for a in ("--exercise", name, str(folder / SOLUTIONS[name]))]


def test_every_solution_passes_its_tests():
    rc, verdicts, out = check(*pairs(EX / "solutions", SOLUTIONS))
    assert verdicts == dict.fromkeys(SOLUTIONS, "PASS") and rc == 0, out
    assert len(re.findall(r"^PASS ", out, re.M)) >= 9 + 9 + 12 + 16, out  # every test ran, none skipped


def test_untouched_starters_and_a_planted_bug_fail(tmp_path):
    rc, verdicts, out = check("--quick", *pairs(EX, ["tp-fg", "flat", "1f1b"]))
    assert verdicts == dict.fromkeys(["tp-fg", "flat", "1f1b"], "FAIL") and rc == 1, out
    for name in ("tp-fg", "flat", "1f1b"):  # each fails by its own starter's NotImplementedError
        assert re.search(rf"^FAIL .*NotImplementedError: exercise {name}:", out, re.M), out
    for name in ("tp-fg", "flat"):  # raised in a spawned rank: the substitution reached the ranks
        assert re.search(rf"^FAIL .*\(rank \d failed: NotImplementedError: exercise {name}:", out, re.M), out
    buggy = tmp_path / "buggy_1f1b.py"
    buggy.write_text(BUGGY_1F1B)
    rc, verdicts, out = check("--quick", *pairs(EX, ["vocab-ce"]), "--exercise", "1f1b", str(buggy))
    assert verdicts == {"vocab-ce": "FAIL", "1f1b": "FAIL"} and rc == 1, out
    assert re.search(r"^FAIL .*NotImplementedError: exercise vocab-ce:", out, re.M), out
    assert re.search(r"^FAIL tests/test_pp.py::test_op_orders_literal .*(assert|Assertion)", out, re.M), out


def test_a_file_without_the_names_is_one_line(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    rc, _, out = check("--exercise", "tp-fg", str(empty))
    assert rc == 2 and out.strip().splitlines() == [
        f"error: {empty} defines no 'CopyToTensorParallel': exercise tp-fg replaces "
        "nanomega.tp:CopyToTensorParallel; keep the starter's names"], out
    rc, _, out = check("--exercise", "no-such", str(empty))
    assert rc == 2 and "choose one of tp-fg, vocab-ce, 1f1b, flat" in out, out


def test_predictions_graded_right_and_wrong(tmp_path):
    rc, _, out = check("--predict", str(EX / "solutions" / "predictions.py"))
    assert rc == 0 and out.count("-> RIGHT") == 8 and "predictions: 8/8 right" in out, out
    starter = (EX / "predictions.py").read_text()  # the untouched starter answers nothing
    assert starter.count(": None,") == 8
    wrong = tmp_path / "wrong.py"  # the starter with two answers: a wrong bubble, (p-1)/(m+p), and a right one
    wrong.write_text(starter.replace('"1f1b-bubble": None', '"1f1b-bubble": 3 / 12')
                     .replace('"gpipe-in-flight": None', '"gpipe-in-flight": 8'))
    rc, _, out = check("--predict", str(wrong))
    assert rc == 1 and "predict 1f1b-bubble (lesson 05): yours 0.25, measured 0.272727 -> WRONG" in out, out
    assert "predict gpipe-in-flight (lesson 05): yours 8, measured 8 -> RIGHT" in out, out
    assert out.count("no prediction yet") == 6 and "predictions: 1/8 right" in out, out
