"""Run by Python at the start of every interpreter whose PYTHONPATH puts this folder first:
lessons/grade.py does, for the pytest it starts, so the substitution of a student's functions
reaches the spawned ranks too (see the docstring of lessons/grade.py). Without $NANOMEGA_EXERCISE it
only hands over to the sitecustomize it shadows."""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain():
    """Run the sitecustomize this one shadows (a distribution's, a virtualenv's), if there is
    one."""
    others = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_chain()
if os.environ.get("NANOMEGA_EXERCISE"):
    try:
        _spec = importlib.util.spec_from_file_location(
            "nanomega_lessons_grade", os.path.join(_HERE, os.pardir, os.pardir, "grade.py")
        )
        _grade = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_grade)
        _grade.substitute_from_env()
    # never grade our code in place of the student's: stop this interpreter
    except BaseException as _error:
        import traceback

        traceback.print_exc()
        print(
            f"grader: could not plug in {os.environ['NANOMEGA_EXERCISE']}: {_error!r}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)
