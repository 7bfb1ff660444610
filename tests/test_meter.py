"""MFU and memory (nanomega/job/meter.py) as the trainer reports them, and the host syncs of a
step."""

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from nanomega import compose, dist, train
from nanomega.job import meter

ROOT = Path(__file__).resolve().parent.parent
CORPUS_CHARS = 100_000  # of the embedded corpus, for conftest's `corpus`
SMALL = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--eval-every",
    "0",
    "--warmup",
    "1",
    "--log-every",
    "2",
]
pytestmark = pytest.mark.usefixtures("one_thread")


def run(corpus, out, *extra):
    train.main(
        [
            *SMALL,
            "--corpus",
            str(corpus),
            "--data-cache",
            str(out.parent / "cache"),
            "--out-dir",
            str(out),
            *extra,
        ]
    )
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_datasheet_peaks():
    tera = 1e12
    assert meter.datasheet_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312 * tera
    assert meter.datasheet_peak("NVIDIA A100-PCIE-40GB", torch.float32) == 156 * tera  # TF32 on
    assert meter.datasheet_peak("NVIDIA A100 80GB PCIe", torch.float32, tf32=False) == 19.5 * tera
    assert meter.datasheet_peak("NVIDIA H100 80GB HBM3", torch.float16) == 989.5 * tera
    assert meter.datasheet_peak("NVIDIA H100 PCIe", torch.bfloat16) == 756.5 * tera
    assert meter.datasheet_peak("NVIDIA H100 PCIe", torch.float32, tf32=False) == 51 * tera
    assert meter.datasheet_peak("Tesla T4", torch.float16) is None  # unknown: measured instead
    # the H200 NVL (PCIe card, 600 W) is not the SXM part: 1,671 vs 1,979 sparse BF16 TFLOP/s on the
    # datasheet
    assert (
        meter.gpu_model("NVIDIA H200") == "H200 SXM"
        and meter.gpu_model("NVIDIA H200 NVL") == "H200 NVL"
    )
    assert meter.datasheet_peak("NVIDIA H200", torch.bfloat16) == 989.5 * tera
    assert meter.datasheet_peak("NVIDIA H200 NVL", torch.bfloat16) == 835.5 * tera
    assert meter.datasheet_peak("NVIDIA H200 NVL", torch.float32) == 417.5 * tera  # TF32 on
    assert meter.datasheet_peak("NVIDIA H200 NVL", torch.float32, tf32=False) == 60 * tera


def test_cpu_peak_is_measured_for_at_least_a_second():
    t0 = time.perf_counter()
    flops, source = meter.peak_flops("cpu", torch.float32)
    assert time.perf_counter() - t0 >= 1.0 and source.startswith("measured") and flops > 0
    assert meter.peak_flops("cpu", torch.float32, override=3e11) == (3e11, "--peak-flops")


def test_metrics_rows_carry_mfu_peak_and_memory(corpus, tmp_path, capsys):
    rows = run(corpus, tmp_path / "measured", "--max-steps", "2")
    out = capsys.readouterr()
    assert "measured: best of" in out.out and "mem " in out.out and "warning" not in out.err
    for r in rows:
        # MFU <= 1 with a real peak
        assert 0 < r["mfu"] <= 1 and r["peak_flops"] > 0 and r["mem_gib"] > 0
    # 1 kFLOP/s: wrong
    rows = run(corpus, tmp_path / "wrong", "--max-steps", "3", "--peak-flops", "1e3")
    err = capsys.readouterr().err.splitlines()
    assert all(r["mfu"] > 1 and r["peak_flops"] == 1e3 for r in rows)
    assert len([line for line in err if "is impossible" in line]) == 1 and "--peak-flops" in err[0]


def test_cpu_peak_memory_resets():
    meter.reset_peak_memory("cpu")
    base = meter.peak_memory_gib("cpu")
    x = torch.ones(2**27)  # 0.5 GiB, touched
    del x
    assert meter.peak_memory_gib("cpu") > base + 0.4
    meter.reset_peak_memory("cpu")
    assert meter.peak_memory_gib("cpu") < base + 0.2


def test_emulated_16_bit_dtype_warns_once(monkeypatch):
    """On this AMD EPYC (AVX2) bf16 really is ~14x slower than fp32; faked here so the test runs
    anywhere."""
    rates = {torch.bfloat16: 30e9, torch.float32: 420e9}
    monkeypatch.setattr(
        meter, "measure_matmul", lambda device, dtype, seconds, n: (rates[dtype], 10)
    )
    line = meter.emulation_warning("cpu", torch.bfloat16)
    assert "0.07x fp32" in line and "use --dtype fp32 here, bf16 on a GPU or an AMX CPU" in line
    assert "\n" not in line
    rates[torch.bfloat16] = 800e9  # an AMX CPU: no warning
    assert meter.emulation_warning("cpu", torch.bfloat16) is None
    assert meter.emulation_warning("cpu", torch.float32) is None


def test_one_device_sync_per_step(monkeypatch):
    """forward_backward returns the loss on the device: no .item() per micro-batch."""
    started = not torch.distributed.is_initialized()
    dist.init("cpu")
    try:
        args = train.flags.parse([*SMALL, "--grad-accum", "4"])
        model, engine, _ = compose.build(args, dist.Grid(1, 1, 1))
        x = torch.randint(0, 100, (4, 32))
        calls = []
        real = torch.Tensor.item
        monkeypatch.setattr(torch.Tensor, "item", lambda t: calls.append(1) or real(t))
        loss = train.forward_backward(
            model, engine, engine.grid, [(x, x)] * 4, args, loss_scale=1.0
        )
        assert torch.is_tensor(loss) and calls == []
    finally:
        if started:
            torch.distributed.destroy_process_group()


def test_host_syncs_per_step(corpus, tmp_path, monkeypatch):
    """Issue 27 item 8: the calls of ours that wait for the device (.item(), .tolist(), float(t),
    ...) in one training step, counted by their call site over steps 4-7 (start-up excluded). Two
    (there were four): the loss and the gradient norm read together before the update
    (train.train_step), and the step-boundary vote (lifecycle.grid_votes), which now also carries
    the weights' finite check after the update (it was a read of its own in zero.masters_finite).
    AdamW's own .item() calls on its step counters are torch's, on the host."""
    sites = collections.Counter()
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu"):
        real = getattr(torch.Tensor, name)

        def counted(t, *a, _real=real, _name=name, **k):
            code = sys._getframe(1).f_code
            if f"{os.sep}nanomega{os.sep}" in code.co_filename:
                sites[
                    (_name, code.co_filename.split(f"{os.sep}nanomega{os.sep}")[-1], code.co_name)
                ] += 1
            return _real(t, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    runs = []
    for steps in (3, 7):
        sites.clear()
        train.main(
            [
                "--n-layer",
                "1",
                "--n-head",
                "2",
                "--n-embd",
                "16",
                "--block-size",
                "16",
                "--batch-size",
                "2",
                "--max-steps",
                str(steps),
                "--eval-every",
                "0",
                "--log-every",
                "1000",
                "--peak-flops",
                "1e11",
                "--device",
                "cpu",
                "--corpus",
                str(corpus),
                "--out-dir",
                str(tmp_path / f"o{steps}"),
                "--data-cache",
                str(tmp_path / "cache"),
            ]
        )
        runs.append(collections.Counter(sites))
    per_step = {site: (runs[1][site] - runs[0][site]) / 4 for site in runs[1] | runs[0]}
    per_step = {site: n for site, n in per_step.items() if n}
    assert per_step == {
        ("tolist", "train.py", "train_step"): 1,
        ("tolist", "job/lifecycle.py", "grid_votes"): 1,
    }, per_step


def test_step_time_includes_the_device_finishing_its_work(monkeypatch, tmp_path):
    """Issue 42 M2: CUDA launches return at once, so a clock stopped right after engine.step
    leaves the optimizer step's device time out (the vote's sync came later, off the clock). The
    row waits for the device first: a device that takes 0.2 s to finish (a stubbed sync) shows in
    tokens/s. No GPU needed: torch.cuda's calls are stubbed."""
    calls = []
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda d=None: calls.append(d) or time.sleep(0.2)
    )
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: None)
    cuda = torch.device("cuda", 0)
    log = meter.MetricsLog(
        str(tmp_path),
        0,
        enabled=False,
        device=cuda,
        flops_per_token=1,
        tokens_per_step=1000,
        world=1,
        peak=1e12,
        source="stub",
        log_every=1,
    )
    rec = log.row(
        step=1, loss=1.0, lr=0.1, grad_norm=1.0, skipped=False, started=time.perf_counter()
    )
    assert calls == [cuda]
    assert rec["tok_s"] <= 1000 / 0.2
