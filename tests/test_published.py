"""The planner against every published row of tools/published.py, in two groups: the calibration
rows its constants were fitted on, and the out-of-sample rows it never saw (within +-10%, or listed
in MISSES with the reason); the overlap model's bookkeeping; the command line reaching the
published layouts; the tables in lesson 21 and bench/RESULTS.md equal to the planner's."""

import contextlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nanomega import dist, formulas as F, worlds
from nanomega.dist import RING
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.precision import cast_model
from nanomega.tools import (
    cost as C,
    cost_time as CT,
    heatmap,
    layouts,
    overlap,
    plan as P,
    published as PUB,
)
from nanomega.zero import ZeroEngine
from nanomega.zero_rules import weight_decay_groups

ROOT = Path(__file__).resolve().parent.parent
ROWS = PUB.rows()


def error(row):
    return PUB.predict(row) / row.published - 1


def test_every_row_has_a_source_a_role_and_a_unique_name():
    assert len({r.name for r in ROWS}) == len(ROWS)
    assert {r.role for r in ROWS} == {"calibration", "out-of-sample"}
    assert all(r.source and r.metric in ("tflops", "mfu", "tokens") for r in ROWS)
    # the constants' fitting set: Table 1's odd rows and BLOOM, nothing else
    calibration = [r.name for r in ROWS if r.role == "calibration"]
    assert calibration == [f"Megatron 2021 T1 row {i} ({n})" for i, n in
                           ((1, "1.7b"), (3, "7.5b"), (5, "39.1b"), (7, "145.6b"), (9, "529.6b"))
                           ] + ["BLOOM-176B"]  # fmt: skip


@pytest.mark.parametrize("row", [r for r in ROWS if r.role == "calibration"], ids=lambda r: r.name)
def test_calibration_rows(row):
    """The rows TimeModel was fitted on stay where the fit put them (lesson 21: within 6.3%)."""
    assert abs(error(row)) < 0.065


def test_out_of_sample_rows_outside_the_band_are_exactly_the_listed_misses():
    outside = {r.name for r in ROWS if r.role == "out-of-sample" and abs(error(r)) > PUB.BAND}
    inside = {r.name for r in ROWS if r.role == "out-of-sample"} - outside
    assert outside == set(PUB.MISSES), "a row crossed the band: update MISSES and the notes"
    assert len(inside) >= 10 and all(PUB.MISSES[n] for n in outside)


def test_overlap_none_is_the_sum_the_constants_were_fitted_with():
    """Run.overlap "none" prices every dp and tp second as waited for (Megatron-LM 2021); the
    overlap model only removes time, never adds it, and never hides more than there is."""
    for row in ROWS:
        plain, own = PUB.estimate(row, plain=True), PUB.estimate(row)
        assert own.step_s <= plain.step_s * (1 + 1e-12), row.name
        assert plain.exposed_s == pytest.approx(plain.comm_s), row.name
        assert 0 <= own.exposed_s <= own.comm_s * (1 + 1e-9), row.name
        assert own.comm_s == pytest.approx(plain.comm_s), row.name


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp_seconds_total_is_the_bytes_and_exposure_is_bounded(zero):
    n, dp, m, bw = 8e9, 64, 4, 50e9
    total = F.dp_comm_bytes(n, zero, dp, 4, 2, m) / bw
    none = overlap.dp_seconds(n, zero, dp, m, 4, 2, bw, 1.0, "none", 33, "none")
    assert none.total == none.exposed == total
    # no compute to hide behind: at least everything; endless compute: the tails and the gathers
    bare = overlap.dp_seconds(n, zero, dp, m, 4, 2, bw, 0.0, "none", 33, "overlap")
    hidden = overlap.dp_seconds(n, zero, dp, m, 4, 2, bw, 1e9, "none", 33, "overlap")
    assert bare.exposed >= total * (1 - 1e-12) and hidden.total == total
    f = (dp - 1) / dp * n / bw
    tail = {0: 2 * 4 * f / 33, 1: 4 * f / 33 + 2 * f, 2: m * 4 * f / 33 + 2 * f, 3: m * 4 * f / 33}
    assert hidden.exposed == pytest.approx(tail[zero])


def test_tp_overlap_hides_behind_the_matmuls_only():
    model, gpu = C.MODELS["llama3-70b"], C.GPUS["h100-sxm"]
    run = C.Run(micro_batch=1, recompute="none", attention="sdpa")
    compute, tp_s, exposed = CT.layer_parts(model, gpu, run, 8)
    assert exposed == tp_s > 0
    _, tp2, hidden = CT.layer_parts(model, gpu, replace(run, tp_overlap=True), 8)
    assert tp2 == tp_s and 0 <= hidden < tp_s
    assert CT.layer_seconds(model, gpu, replace(run, tp_overlap=True), 8) == compute + hidden


def _zero3_micro_batches(ms):
    """{m: one rank's dp bytes in one ZeRO-3 step of m micro-batches (train.py's loop)}, each m
    on its own grid of one world (one world's start, not one per m)."""
    return {m: _zero3_step_bytes(dist.Grid(2, 1, 1), m) for m in ms}


def _zero3_step_bytes(grid, m):
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    model = cast_model(GPT(cfg), torch.bfloat16)
    engine = ZeroEngine(model, torch.optim.AdamW, weight_decay_groups(0.1, lr=1e-3), grid, 3,
                        bucket_mb=0.1, grad_dtype=torch.bfloat16)  # fmt: skip
    x = torch.randint(0, 128, (m, 2, 32), generator=torch.Generator().manual_seed(grid.rank))
    for _step in range(2):  # the second step is measured
        grid.log.reset()
        for i in range(m):
            with engine.no_sync() if i < m - 1 else contextlib.nullcontext():
                model(x[i], x[i]).backward()
        engine.step(clip_norm=1.0)
    psi = sum(p.numel() for p in GPT(cfg).parameters())
    return psi, {op: grid.log.bytes(op, "dp") for op in RING}


def test_zero3_gathers_every_micro_batch_in_the_engine_and_the_planner():
    """zero3.py gathers each unit before every micro-batch's forward and backward and
    reduce-scatters every micro-batch: formulas.dp_comm_bytes(..., m), which overlap.dp_seconds
    prices, counts the same bytes (not one gather per step, as FSDP with reshard_after_forward off
    could)."""
    measured = worlds.launch(_zero3_micro_batches, 2, (1, 3), timeout=300)[0]
    for m, (psi, sent) in measured.items():
        on_wire = sum(RING[op](2) * b for op, b in sent.items())
        norm = (8 + 4) * RING["all_reduce"](2)  # the global norm's fp64 sum and the finite count
        assert on_wire == F.dp_comm_bytes(psi, 3, 2, 2, 2, m) + norm


def test_tables_in_the_lesson_and_results_are_the_planners():
    table = PUB.table()
    for doc in ("lessons/21-planning-a-run.md", "bench/RESULTS.md"):
        assert table in (ROOT / doc).read_text(), f"{doc}: paste python -m nanomega.tools.published"


@pytest.mark.parametrize("gpus", [8192, 16384])
def test_cli_plans_llama3_405b_published_layouts(gpus, capsys):
    """Llama 3 405B's Table 4 layouts from the command line: the same estimate as the published
    row's (the memory model says it does not fit with ZeRO-1's unsharded fp32 gradients: the table
    is printed, then why)."""
    row = next(r for r in ROWS if r.name == f"Llama 3 405B, {gpus} GPUs")
    argv = ["--model", "llama3-405b", "--gpus", str(gpus), "--gpu", "h100-sxm", "--global-batch",
            "2048", "--tp", "8", "--pp", "16", "--zero", "1", "--schedule", "interleaved",
            "--chunks", "8", "--split", "llama3", "--recompute", "none", "--overlap", "overlap"]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        P.main(argv)
    assert "no layout fits" in str(e.value) and "unpin" in str(e.value)
    line = capsys.readouterr().out.splitlines()[2].split()
    assert line[:3] == ["8", "16", str(gpus // 128)]
    assert float(line[-3]) == round(PUB.predict(row), 1)
    # with memory to spare (a B200) it is recommended, and the JSON carries the same step
    P.main(argv[:5] + ["b200"] + argv[6:] + ["--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["gpu"] == "b200" and out["estimates"][0]["layers_per_stage"][0] == 7


def test_cli_plans_the_131k_context_parallel_row(capsys):
    row = next(r for r in ROWS if r.cp > 1)
    argv = ["--model", "llama3-405b", "--seq", "131072", "--gpus", "16384", "--gpu", "h200",
            "--hbm-tbps", "3.35", "--global-batch", "128", "--tp", "8", "--pp", "16", "--cp", "16",
            "--zero", "1", "--schedule", "interleaved", "--chunks", "8", "--split", "llama3",
            "--recompute", "none", "--overlap", "overlap", "--json"]  # fmt: skip
    P.main(argv)
    e = json.loads(capsys.readouterr().out)["estimates"][0]
    # H200 measured at H100's HBM bandwidth is an H100 SXM with more memory: the row's estimate
    assert (e["dp"], e["micro_batches"]) == (8, 16)
    assert e["tflops_per_gpu"] == round(PUB.predict(row), 1)
    with pytest.raises(SystemExit) as err:
        P.main(argv[:-1] + ["--cp", "3"])
    assert "--cp 3 needs" in str(err.value)


def test_gpu_presets_are_the_datasheets():
    g = C.GPUS
    assert g["h100-sxm"] == g["h100-80gb"] and g["h200"].peak_flops == g["h100-sxm"].peak_flops
    assert (g["h200"].memory, g["h200"].hbm_bw) == (141e9, 4.8e12)
    assert (g["b200"].peak_flops, g["b200"].memory, g["b200"].hbm_bw) == (2.25e15, 180e9, 8e12)
    assert g["h100-pcie"].peak_flops == 756e12 and g["h100-pcie"].intra_bw < g["h100-sxm"].intra_bw


def test_heatmap_numbers_are_the_planners(tmp_path):
    """Each cell of lesson 21's figure is the best MFU among the layouts that fit, computed here
    the long way (every ZeRO stage through layout_error and cost_time.evaluate); the figure's texts
    are those numbers."""
    g = heatmap.lesson_grid()
    model, gpu, run = C.MODELS["llama3-70b"], C.GPUS["h100-sxm"], heatmap.LESSON_RUN
    for (tp, pp), row in zip(g.layouts, g.mfu):
        for n, cell in zip(g.nodes, row):
            gpus = 8 * n
            ests = [CT.evaluate(model, gpu, gpus, tp, pp, z, run) for z in range(4)
                    if not layouts.layout_error(model, gpu, gpus, tp, pp, z, run)]  # fmt: skip
            fit = [e.mfu for e in ests if e.fits]
            assert cell == (pytest.approx(max(fit)) if fit else None), (tp, pp, n)
    assert sum(x is not None for row in g.mfu for x in row) >= 30
    pytest.importorskip("matplotlib", reason="drawing needs the plot extra (matplotlib)")
    fig = heatmap.draw(g, tmp_path / "mfu.png")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == [heatmap.label(x) for row in g.mfu for x in row if x is not None]
    assert (tmp_path / "mfu.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "flag,value", [("--cp", "0"), ("--peak-tflops", "nan"), ("--hbm-tbps", "-1")]
)
def test_cli_refuses_bad_measured_numbers(flag, value):
    with pytest.raises(SystemExit) as e:
        P.main(["--model", "tiny", "--gpus", "4", "--global-batch", "8", flag, value])
    assert str(e.value) == "plan: --cp, --peak-tflops and --hbm-tbps must be positive and finite"
