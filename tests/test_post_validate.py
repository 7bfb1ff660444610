"""ZB-H2's post-validation (nanomega/post_validate.py): the step without the pipeline's barrier.

The timing: ZB-H2's steps chained with no barrier on the simulator run with each rank's period
equal to the paper's Table 1 row, m (T_F + T_B + T_W) + (p - 1)(T_F + T_B - 2 T_W), where the
synchronized step takes (p - 1) max(T_F, T_F + T_B - 2 T_W) of ramp. The runtime: --post-validate
steps at once and redoes the step when the global norm clips; both ways bitwise the synchronized
step's losses and weights (dp 2 x pp 2, ZeRO-1), the rollback path counted.
"""

import pytest
import zb_dense
from test_layouts import COMMON

from nanomega import formulas, post_validate, schedules, worlds

TIMES = [(1, 1, 1), (1, 2, 1), (2, 2, 1), (3, 2, 1), (1, 1, 1 / 2)]  # (T_F, T_B, T_W)


def test_zb_h2_without_the_barrier_runs_at_the_papers_bubble():
    """Two ZB-H2 steps back to back on the NCCL-strict simulator, each rank starting its second
    step when it has finished its first (the optimizer step post-validated, taking no time): every
    rank's period is m (T_F + T_B + T_W) + (p - 1)(T_F + T_B - 2 T_W), the paper's Table 1 ZB-H2
    row (T_F + T_B >= 2 T_W), for p 2-8 and m from 2p - 1 to 3p. With the barrier the step's ramp
    is (p - 1) max(T_F, T_F + T_B - 2 T_W) (formulas.RAMP_SLOTS). The planner prices the
    post-validated step at the paper's row: no bubble at T_F = T_B = T_W."""
    for p in (2, 3, 4, 8):
        for m in (2 * p - 1, 2 * p, 3 * p):
            for t_f, t_b, t_w in TIMES:
                ops = post_validate.chained(schedules.zb_h2, 2)
                times = dict(t_f=t_f, t_b=t_b, t_w=t_w)
                traces = schedules.simulate(p, 2 * m, ops, timed=True, **times)
                paper = m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - 2 * t_w)
                assert post_validate.period(traces, m) == [paper] * p, (p, m, times)

                # the synchronized step: from the first op of any rank to the last of any
                one = schedules.simulate(p, m, "zb-h2", **times)
                span = max(e.end for t in one for e in t.events)
                ramp = (p - 1) * max(t_f, t_f + t_b - 2 * t_w)
                assert span == m * (t_f + t_b + t_w) + ramp, (p, m, times)

    # the planner at T_F = T_B = T_W: the chained period m 3T (above), no bubble; synchronized, 1/3
    # slot of ramp per stage
    for p, m in ((2, 3), (4, 8), (8, 24)):
        assert (
            formulas.pipeline_bubble(p, m, formulas.ramp_slots("zb-h2", post_validated=True)) == 0
        )
        assert formulas.ramp_slots("zb-h2") == formulas.RAMP_SLOTS["zb-h2"] == 3
        assert formulas.ramp_slots("zb-h1", post_validated=True) == formulas.RAMP_SLOTS["zb-h1"]


def test_refusals():
    """One line each, where post-validation cannot compose."""
    assert "--pp >= 2" in post_validate.error(1, "adamw", 0, 0)
    assert "--optimizer adamw" in post_validate.error(2, "muon", 0, 0)
    assert "--offload" in post_validate.error(2, "adamw", 0.5, 0)
    assert "ZeRO++" in post_validate.error(2, "adamw", 0, 1)
    assert post_validate.error(2, "adamw", 0, 0) is None


LAYOUT = ["--pp", "2", "--zero", "1", "--schedule", "zb-h2", "--batch-size", "1"]
# never clips; clips every step; never clips, but step 3's update is dropped (an injected spike)
CASES = {"1000": [], "0.01": [], "skip": ["--on-spike", "skip", "--inject-fault", "spike:0:3"]}
RUNS = [
    (f"{case}-{mode}", [*LAYOUT, "--grad-accum", "4", "--grad-clip", clip, *CASES[case], *extra])
    for case, clip in (("1000", "1000"), ("0.01", "0.01"), ("skip", "1000"))
    for mode, extra in (("sync", []), ("post", ["--post-validate"]))
]


def _runs(corpus, root):
    zb_dense.train_runs(corpus, root, RUNS)
    return dict(post_validate.COUNTS)


def test_post_validated_step_equals_the_synchronized_step_bitwise(corpus, tmp_path):
    """dp 2 x pp 2, ZeRO-1, ZB-H2: --post-validate's losses, validation loss and final weights
    bitwise the synchronized step's, when no clip is needed (no rollback), when every step clips
    (every step rolled back and redone with the global norm) and when a spike drops a step's
    update (rolled back, not redone). A rollback that does not restore the kept masters and state
    fails here."""
    counts = worlds.launch(_runs, 4, corpus, tmp_path, timeout=600)
    steps = int(COMMON[COMMON.index("--max-steps") + 1])
    for case in CASES:
        zb_dense.bitwise_equal(tmp_path, f"{case}-sync", f"{case}-post")
    # per rank: the three post-validated runs' steps; the clipped run's rolled back, the spike's
    # step, nothing else
    assert all(c == {"steps": 3 * steps, "rolled_back": steps + 1} for c in counts), counts


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
