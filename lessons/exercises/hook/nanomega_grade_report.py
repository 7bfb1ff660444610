"""The grader's pytest plugin (`-p nanomega_grade_report`, loaded by lessons/grade.py): one JSON
line per test phase in $NANOMEGA_GRADE_REPORT, written from the exception object itself, never from
pytest's wording.

A line: {"node": id, "when": setup | call | teardown, "outcome": passed | failed | skipped,
"reason": text}.
A spawned rank's failure (nanomega.worlds.RankFailed) reads "rank N failed: Type: first line of its
message".
It uses only pytest's hook API (pytest_runtest_makereport, pytest_runtest_logreport), the same on
every version pyproject allows.
"""

import json
import os

_EXCEPTIONS = {}  # (node id, phase) -> the exception that phase raised


def _first_line(text):
    lines = str(text).strip().splitlines()
    return lines[0].strip()[:200] if lines else ""


def reason(error):
    """One line: what was raised, and where, when a spawned rank raised it."""
    from nanomega.worlds import RankFailed

    if isinstance(error, RankFailed):
        return f"rank {error.rank} failed: {error.kind}: {_first_line(error.message)}"
    return f"{type(error).__name__}: {_first_line(error)}"


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None:
        _EXCEPTIONS[item.nodeid, call.when] = call.excinfo.value
    # returns None: pytest's own implementation still makes the report


def pytest_runtest_logreport(report):
    error = _EXCEPTIONS.pop((report.nodeid, report.when), None)
    line = dict(
        node=report.nodeid,
        when=report.when,
        outcome=report.outcome,
        reason=reason(error) if error is not None else "",
    )
    # line by line: a crash keeps what ran
    with open(os.environ["NANOMEGA_GRADE_REPORT"], "a") as f:
        f.write(json.dumps(line) + "\n")
