"""The minimal-build track (lessons/minimal/): naive DP -> bucketed DP -> ZeRO-1 and AFAB -> 1F1B,
each equal to the dense single-process model over STEPS AdamW steps.

One spawned world of 2 runs all five files' train() and, on rank 0, the dense references
(lessons/minimal/ common.py:dense). Bitwise where the math guarantees it (common.py's docstring):
against the dense model run on the same pieces of the batch -- the 2 ranks' row blocks (DP, ZeRO-1)
or the 4 micro-batches (pipelines) -- every loss and every final weight, on every rank. Against one
forward over the whole batch, only the order of the sums differs: losses within
tolerance.layout_rtol (vocabulary 256, sums of <= 256 terms, 4 reductions per layer x 2 layers + the
head).
"""

import sys
from pathlib import Path

import pytest
import torch

from nanomega import worlds
from tolerance import layout_rtol

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lessons" / "minimal"))
import common  # noqa: E402  (lessons/minimal/common.py; the spawned ranks inherit this sys.path)
import dp_bucketed  # noqa: E402
import dp_naive  # noqa: E402
import pp_1f1b  # noqa: E402
import pp_afab  # noqa: E402
import zero1  # noqa: E402

DP = {"dp_naive": dp_naive, "dp_bucketed": dp_bucketed, "zero1": zero1}
PP = {"pp_afab": pp_afab, "pp_1f1b": pp_1f1b}
RTOL = layout_rtol(
    common.STEPS, common.CONFIG.vocab_size, width=256, depth=4 * common.CONFIG.n_layer + 1
)


def _world():
    out = {name: module.train() for name, module in {**DP, **PP}.items()}
    if torch.distributed.get_rank() == 0:
        out["dense"] = {pieces: common.dense(pieces) for pieces in (1, 2, pp_afab.MICRO)}
    return out


@pytest.fixture(scope="module")
def world():
    return worlds.launch(_world, 2, timeout=240)


@pytest.mark.parametrize("name", DP)
def test_data_parallel_equals_dense_bitwise(world, name):
    losses, weights = world[0]["dense"][2]
    for rank in world:  # every replica: the same losses and weights as one process, bit for bit
        assert rank[name]["losses"] == losses
        assert rank[name]["weights"] == weights


@pytest.mark.parametrize("name", PP)
def test_pipeline_equals_dense_bitwise(world, name):
    losses, weights = world[0]["dense"][pp_afab.MICRO]
    stages = [rank[name]["weights"] for rank in world]
    # split, and equal
    assert not set(stages[0]) & set(stages[1]) and {**stages[0], **stages[1]} == weights
    for rank in world:
        assert rank[name]["losses"] == losses


@pytest.mark.parametrize("name", [*DP, *PP])
def test_losses_match_one_forward_over_the_whole_batch(world, name):
    whole = world[0]["dense"][1][0]
    for got, want in zip(world[0][name]["losses"], whole):
        assert abs(got - want) <= RTOL * abs(want), (got, want, RTOL)
    assert world[0][name]["losses"][-1] < whole[0] - 0.3  # and the model learns: the loss falls


def test_the_files_measure_what_they_claim(world):
    params = world[0]["zero1"]["params"]
    # every gradient once, plus the loss
    assert world[0]["dp_naive"]["bytes_per_step"] == 4 * params + 4
    assert world[0]["dp_bucketed"]["calls"] == world[0]["dp_bucketed"]["buckets"] > 1
    assert world[0]["zero1"]["state_bytes"] == 8 * -(-params // 2)  # m and v of this rank's half
    # reduce-scatter + all-gather of the padded 2 S elements (+ the loss): an all-reduce's wire
    # bytes
    assert world[0]["zero1"]["wire"] == 4 * 2 * -(-params // 2) + 4
    # p - k on stage k, not m = 4
    assert [rank["pp_1f1b"]["peak_in_flight"] for rank in world] == [2, 1]
