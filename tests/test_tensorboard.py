"""--tensorboard DIR: every number of metrics.jsonl's rows written as a TensorBoard scalar at its
step, read back with TensorBoard's own reader (EventAccumulator), equal to the JSON lines to
float32 (the event files hold float32). A resume purges the events after the step it restarts from,
as it removes those rows from metrics.jsonl.
"""

import json

import numpy as np
import pytest

pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from nanomega import train  # noqa: E402
from test_layouts import flags  # noqa: E402

CORPUS_CHARS = 200_000
COMMON = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32"]
COMMON += ["--batch-size", "4", "--warmup", "1", "--eval-every", "2", "--eval-iters", "1"]
COMMON += ["--log-every", "100", "--peak-flops", "1e11", "--save-every", "2"]


def test_tensorboard_events_are_the_logged_metrics(corpus, tmp_path):
    out, tb = tmp_path / "run", tmp_path / "tb"
    train.main(flags(corpus, out, ["--max-steps", "3", "--tensorboard", str(tb)], COMMON))
    first = [json.loads(line) for line in open(out / "metrics.jsonl")]
    # crashed after step 3, resumed from step 2's checkpoint: step 3 is redone, not doubled
    train.main(
        flags(
            corpus,
            out,
            ["--max-steps", "4", "--tensorboard", str(tb), "--resume-from", "2"],
            COMMON,
        )
    )

    # (a resume keeps metrics.jsonl's rows 1 .. its step: step 0's validation is the first run's)
    rows = first[:1] + [json.loads(line) for line in open(out / "metrics.jsonl")]
    want = {}  # tag -> [(step, value)]
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                want.setdefault(key, []).append((row["step"], np.float32(value)))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert {"loss", "val_loss", "lr", "grad_norm", "tok_s", "mfu", "mem_gib"} <= want.keys()

    events = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(want)
    for tag, values in want.items():
        got = [(e.step, np.float32(e.value)) for e in events.Scalars(tag)]
        assert got == values, tag
