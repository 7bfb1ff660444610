"""Print a measured value next to its formula; a lesson script exits 1 if any check disagrees.

Every `check ... -> OK` line a lesson shows must appear verbatim in its script's output
(tests/test_lessons.py runs each script and asserts this), so lessons cannot rot.
Run as a script, it grades exercises (lessons/grade.py, lessons/exercises/README.md):
    python lessons/check.py --exercise tp-fg lessons/exercises/tp_fg.py
    python lessons/check.py --predict lessons/exercises/predictions.py
"""

import atexit
import os

_failed = []


def _fmt(v):
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return f"{int(v):,}"
    return f"{v:.6g}"


def check(name, measured, formula, rtol=0.0, atol=0.0, unit="", labels=("measured", "formula")):
    """`labels` name the two sides when they are not a measurement and a formula (a planner's value
    and a paper's, a formula and a published figure): a printed label must say where the number came
    from."""
    ok = abs(measured - formula) <= atol + rtol * abs(formula)
    tol = f" (rtol {rtol:g})" if rtol else (f" (atol {atol:g})" if atol else "")
    print(
        f"check {name}: {labels[0]} {_fmt(measured)}{unit}, {labels[1]} {_fmt(formula)}{unit}{tol} -> "
        f"{'OK' if ok else 'MISMATCH'}",
        flush=True,
    )
    if not ok:
        _failed.append(name)
    return ok


@atexit.register
def _exit_status():
    if _failed:
        print(f"{len(_failed)} check(s) failed: {', '.join(_failed)}", flush=True)
        os._exit(1)


if __name__ == "__main__":
    import sys

    import grade  # lessons/grade.py: this script's folder is on sys.path

    sys.exit(grade.main(sys.argv[1:]))
