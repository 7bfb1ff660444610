"""The planner's formulas (nanomega/formulas.py) against what real CPU runs of the ZeRO engine
measure: bytes held per rank and bytes sent per step, ZeRO stages 0-3 at dp = 2 (a bf16 model, bf16
gradients, AdamW)."""

import sys
from pathlib import Path

import pytest

from nanomega import formulas, worlds
from nanomega.dist import RING
from nanomega.model import GPT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lessons"))
import importlib  # noqa: E402

# its run_stages measures one rank's memory and traffic
zero_lesson = importlib.import_module("04_zero")


@pytest.fixture(scope="module")
def measured():
    return worlds.launch(zero_lesson.run_stages, 2, 2, timeout=300)[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_planner_predicts_measured_bytes(measured, stage):
    psi = sum(p.numel() for p in GPT(zero_lesson.CFG).parameters())
    r = measured[stage]
    held = sum(r["memory"].values())
    predicted = sum(
        formulas.zero_state_bytes(psi, stage, 2, param_bytes=2, grad_bytes=2, optim_bytes=12)
    )
    assert held == predicted + 4 * r["pieces"]  # + AdamW's 4-byte step counter per parameter piece
    sent = sum(RING[op](2) * b for op, b in r["bytes"].items())
    # + 8: sharded gradients need the global norm's fp64 sum of squares all-reduced over dp (one
    # scalar); + 4: sharded masters, the fp32 count of non-finite ones after the update
    # (zero.ZeroEngine.masters_finite)
    norm = (8 + 4) * RING["all_reduce"](2) if stage else 0
    assert sent == formulas.dp_comm_bytes(psi, stage, 2, dtype_bytes=2) + norm
