"""The layout fuzzer's CI sample (tests/fuzz.py): seeded draws of valid layouts, each equal to the
one-process run of its model, and of invalid configurations, each refused in one line before any
collective with nothing written. The seed is printed; NANOMEGA_FUZZ_SEED=S draws another sample;
`python -m tests.fuzz --minutes M` is the long mode.

Tolerance: fuzz.RTOL = tolerance.layout_rtol for STEPS steps of the tiny model (every loss).
"""

import pytest

pytest.importorskip("hypothesis", reason="the test extra: pip install -e '.[test]'")
import fuzz  # noqa: E402
from nanomega.job import flags  # noqa: E402

VALID, INVALID = 4, 150  # about two minutes on a 2-core machine


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    print(f"fuzz seed {fuzz.SEED} (NANOMEGA_FUZZ_SEED)")
    return fuzz.Data(tmp_path_factory.mktemp("fuzz"))


def test_every_flag_is_drawn_or_excused():
    """A new flag fails here until the fuzzer draws it or says why not."""
    names = {f.name for f in flags.FLAGS}
    assert fuzz.DRAWN | set(fuzz.NOT_DRAWN) == names, names ^ (fuzz.DRAWN | set(fuzz.NOT_DRAWN))
    assert not fuzz.DRAWN & set(fuzz.NOT_DRAWN)


def test_invalid_configurations_are_refused_in_one_line(data):
    fuzz.fuzz_invalid(data, fuzz.SEED, INVALID)
    print(fuzz.report())


def test_sampled_layouts_equal_one_process(data):
    fuzz.fuzz_valid(data, fuzz.SEED, VALID)
    print(fuzz.report())


# the defects the fuzzer found, each a named regression test (its shrunk example)
def test_regression_unknown_router_without_experts_is_refused(data):
    """`--router 0` without --n-experts trained on, the typo unnoticed until experts were added:
    moe.check returned before reading the router when there were no experts."""
    fuzz.check_refusal(data, {"router": "0"}, 1, ["router"])
