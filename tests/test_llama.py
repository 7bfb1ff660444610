"""The Llama block (RMSNorm, SwiGLU, rotary positions, 4 query heads sharing 2 key/value heads, an
untied head) in every parallel form equals the dense Llama: losses, validation loss and the updated
weights after several steps.

Layouts: tp2, tp2 + SP, pp2 (1F1B, the head on its own stage), ZeRO-3 dp2, tp2 x pp2 with SP and
selective recompute, and tp4 -- four ranks for two key/value heads: tp.GroupKeyValue holds the k/v
weight whole on each rank and sums its gradient over tp -- with full recompute, and with SP; then
tp4's step-2 checkpoint resumed at tp2 x dp2 ZeRO-1 (a replicated kv_proj resharded into a split
one).
Tolerance (derived, tests/tolerance.py): layout_rtol with V = 4096 and the f = 64-term sums of DEPTH
= 21 reductions (4 layers x (q, kv, o, gate/up, down) + head), 4 steps. Weights: as
tests/test_layouts.py (atol 1e-4 relative to std-0.02 weights, 3% of one Adam step at lr 3e-3).
"""

import pytest
import torch

from nanomega import checkpoint, reshard, train, worlds
from test_layouts import curve, flags, run_layouts
from tolerance import layout_rtol

CORPUS_CHARS = 200_000
STEPS = 4
COMMON = [
    "--arch",
    "llama",
    "--n-layer",
    "4",
    "--n-head",
    "4",
    "--n-kv-head",
    "2",
    "--n-embd",
    "32",
    "--ffn-hidden",
    "64",
    "--untie-embeddings",
    "--rope-theta",
    "500000",
    "--block-size",
    "32",
    "--max-steps",
    str(STEPS),
    "--warmup",
    "1",
    "--lr",
    "3e-3",
    "--eval-every",
    str(STEPS),
    "--eval-iters",
    "2",
    "--log-every",
    "100",
    "--peak-flops",
    "1e11",
    "--save-every",
    "2",
]
RTOL = layout_rtol(STEPS, vocab=4096, width=64, depth=21)
LAYOUTS_2 = [  # global batch 8 everywhere
    ("tp2", ["--tp", "2", "--batch-size", "2", "--grad-accum", "4"]),
    ("tp2-sp", ["--tp", "2", "--sequence-parallel", "--batch-size", "2", "--grad-accum", "4"]),
    ("pp2-1f1b", ["--pp", "2", "--batch-size", "1", "--grad-accum", "8"]),
    ("dp2-zero3", ["--zero", "3", "--batch-size", "2", "--grad-accum", "2"]),
]
LAYOUTS_4 = [
    (
        "tp2-pp2-sp-selective",
        [
            "--tp",
            "2",
            "--pp",
            "2",
            "--sequence-parallel",
            "--recompute",
            "selective",
            "--batch-size",
            "2",
            "--grad-accum",
            "4",
        ],
    ),
    ("tp4-full", ["--tp", "4", "--recompute", "full", "--batch-size", "2", "--grad-accum", "4"]),
    ("tp4-sp", ["--tp", "4", "--sequence-parallel", "--batch-size", "2", "--grad-accum", "4"]),
]


# tp2 x dp2 in a world of 4
RESUME = ["--tp", "2", "--zero", "1", "--batch-size", "2", "--grad-accum", "2"]


@pytest.fixture(scope="module")
def dense(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("dense") / "dense"
    train.main(flags(corpus, out, ["--batch-size", "2", "--grad-accum", "4"], COMMON))
    return out


def assert_same_run(out, dense_out, first_step=1):
    (losses, val), (ref, ref_val) = curve(out), curve(dense_out)
    assert ref[-1] < ref[0] - 0.05  # it trains, and the test can tell curves apart
    assert losses == pytest.approx(ref[first_step - 1 :], rel=RTOL), (out.name, losses, ref)
    assert val == pytest.approx(ref_val, rel=RTOL)
    a = reshard.full_weights(checkpoint.latest(out))
    b = reshard.full_weights(checkpoint.latest(dense_out))
    assert (
        a.keys() == b.keys() and "head.lm_head.weight" in a and "blocks.0.attn.kv_proj.weight" in a
    )
    for k in a:
        torch.testing.assert_close(
            a[k], b[k], rtol=1e-4, atol=1e-4, msg=lambda m: f"{out.name} {k}: {m}"
        )


def test_two_rank_layouts_match_the_dense_llama(corpus, dense, tmp_path):
    worlds.launch(run_layouts, 2, corpus, tmp_path, LAYOUTS_2, None, COMMON, timeout=600)
    for name, _ in LAYOUTS_2:
        assert_same_run(tmp_path / name, dense)


def test_four_rank_layouts_and_a_replicated_kv_reshard_match_the_dense_llama(
    corpus, dense, tmp_path
):
    worlds.launch(
        run_layouts, 4, corpus, tmp_path, LAYOUTS_4, "tp4-full", COMMON, RESUME, timeout=600
    )
    for name, _ in LAYOUTS_4:
        assert_same_run(tmp_path / name, dense)
    assert_same_run(tmp_path / "resumed", dense, first_step=3)
