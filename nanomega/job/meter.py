"""Model FLOPs utilisation and memory: how much of the hardware a training step uses.

MFU (PaLM, appendix B) divides the model's own arithmetic (formulas.model_flops_per_token, not what
recompute adds) by the device's peak in the dtype the matmuls run in: a known GPU's datasheet number
(the table below), --peak-flops, or else a measured matmul peak, labelled "measured". Memory is this
rank's peak over each log interval. MetricsLog writes the log lines and OUT/metrics.jsonl, and with
--tensorboard DIR each row's numbers as TensorBoard scalars (tag = the row's key, at its step).

Formula: MFU = model FLOPs per token x tokens per second / (devices x peak FLOP/s)
         (MFU above 1 is impossible: the peak is wrong, and the trainer says so once)
Lesson: lessons/01-dense-model.md
"""

import json
import math
import os
import re
import resource
import sys
import time

import torch

from nanomega import checkpoint, precision
from nanomega.formulas import model_flops_per_token
from nanomega.precision import dtype_name

# TFLOP/s per GPU, dense (NVIDIA datasheets print 2:4-sparse numbers for tensor cores: half of those
# here). "tf32" is fp32 matmul on tensor cores (torch.backends.cuda.matmul.fp32_precision,
# train.py's --tf32). Sources: NVIDIA A100 Tensor Core GPU datasheet
# (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf, table "A100 80GB PCIe / A100 80GB SXM": the
# same peaks for SXM and PCIe); NVIDIA H100 Tensor Core GPU datasheet
# (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet: H100 SXM / H100 PCIe
# columns: FP32 67 / 51, TF32 989 / 756 sparse, BF16 and FP16 1,979 / 1,513 sparse); NVIDIA H200
# datasheet (nvidia.com/en-us/data-center/h200, H200 SXM / H200 NVL columns: FP32 67 / 60, TF32 989
# / 835 sparse, BF16/FP16 1,979 / 1,671 sparse: the SXM part has the H100 SXM's compute, the NVL
# (PCIe card, 600 W) less).
PEAK_TFLOPS = {
    "A100 SXM": dict(fp32=19.5, tf32=156.0, bf16=312.0, fp16=312.0),
    "A100 PCIe": dict(fp32=19.5, tf32=156.0, bf16=312.0, fp16=312.0),
    "H100 SXM": dict(fp32=67.0, tf32=494.5, bf16=989.5, fp16=989.5),
    "H100 PCIe": dict(fp32=51.0, tf32=378.0, bf16=756.5, fp16=756.5),
    "H200 SXM": dict(fp32=67.0, tf32=494.5, bf16=989.5, fp16=989.5),
    "H200 NVL": dict(fp32=60.0, tf32=417.5, bf16=835.5, fp16=835.5),
}
EMULATED = 0.5  # a 16-bit matmul slower than half fp32's rate: the CPU has no 16-bit units for it


def gpu_model(name: str):
    """The PEAK_TFLOPS row of a torch.cuda.get_device_name(), e.g. 'NVIDIA A100-SXM4-80GB', or
    None."""
    n = name.lower()
    if "h200" in n:  # 'NVIDIA H200' (SXM) or 'NVIDIA H200 NVL'
        return "H200 NVL" if "nvl" in n else "H200 SXM"
    if "h100" in n and "nvl" not in n:
        return "H100 PCIe" if "pcie" in n else "H100 SXM"
    if "a100" in n:
        return "A100 PCIe" if "pcie" in n else "A100 SXM"
    return None


def datasheet_peak(name: str, dtype: torch.dtype, tf32: bool = True):
    """Peak FLOP/s of GPU `name` for matmuls in `dtype` (fp32 -> tf32 when tf32 is on),
    or None if unknown."""
    row = gpu_model(name)
    if row is None:
        return None
    key = dtype_name(dtype)
    return PEAK_TFLOPS[row]["tf32" if key == "fp32" and tf32 else key] * 1e12


def measure_matmul(device, dtype, seconds=1.0, n=None):
    """(best FLOP/s, repetitions) of n x n matmuls in `dtype`, repeated for at least `seconds`."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up: kernels chosen, caches filled
    sync()
    best, reps, start = float("inf"), 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return 2 * n**3 / best, reps


def peak_flops(device, dtype, tf32=True, override=None):
    """(peak FLOP/s per device, where it comes from): --peak-flops, the datasheet, or a
    measurement."""
    device = torch.device(device)
    if override:
        return float(override), "--peak-flops"
    name = dtype_name(dtype) + (
        "/tf32" if dtype == torch.float32 and tf32 and device.type == "cuda" else ""
    )
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        peak = datasheet_peak(gpu, dtype, tf32)
        if peak:
            return peak, f"datasheet, {gpu_model(gpu)} {name}"
    flops, reps = measure_matmul(device, dtype)
    return flops, f"measured: best of {reps} {name} matmuls over >= 1 s"


def emulation_warning(device, dtype, seconds=0.25):
    """One line if this CPU runs `dtype` matmuls at less than EMULATED x fp32's rate, else None."""
    device = torch.device(device)
    if device.type != "cpu" or dtype == torch.float32:
        return None
    n = 512  # small: a clear ratio in 2 x `seconds`, even where 16 bits is 14x slower
    slow, fast = (
        measure_matmul(device, dtype, seconds, n)[0],
        measure_matmul(device, torch.float32, seconds, n)[0],
    )
    if slow >= EMULATED * fast:
        return None
    name = dtype_name(dtype)
    return (
        f"warning: --dtype {name} matmuls run at {slow / fast:.2f}x fp32's rate on this CPU "
        f"({slow / 1e9:.0f} vs {fast / 1e9:.0f} GFLOP/s measured): it emulates {name}; use --dtype fp32 "
        f"here, {name} on a GPU or an AMX CPU"
    )


def device_done(device):
    """Wait until the device has run what was queued: a clock stopped after this measures device
    time, not launch time (CUDA launches return at once). A no-op on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mfu(flops_per_token, tokens_per_s, devices, peak):
    return flops_per_token * tokens_per_s / (devices * peak)


def _vm_hwm_bytes():
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB; never reset


def peak_memory_gib(device) -> float:
    """This rank's peak memory since the last reset: CUDA allocated by torch, or the
    CPU process's RSS."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return _vm_hwm_bytes() / 2**30


def reset_peak_memory(device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux >= 4.0: "5" resets VmHWM to the current RSS
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # elsewhere the peak is since start (documented in the log header)


def require_tensorboard():
    """torch.utils.tensorboard's SummaryWriter, or one line naming the extra to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(
            "--tensorboard needs the tensorboard package: pip install 'nanomega[tensorboard]'"
        ) from None
    return SummaryWriter


def open_log(config, cfg, grid, step, *, n_params, log):
    """A run's MetricsLog, after its start-up lines. The MFU peak: the logging rank measures it (the
    others would compete for the same cores); the others, which log nothing, report a peak of 1."""
    peak, source = 1.0, ""
    if log:
        dtype = precision.parse_dtype(config.dtype)
        peak, source = peak_flops(grid.device, dtype, config.tf32, config.peak_flops)
        warning = emulation_warning(grid.device, dtype)
        if warning:
            print(warning, file=sys.stderr)

        if config.tp > 1:
            print(
                f"vocab padded from {cfg.vocab_size} to {cfg.padded_vocab_size} (a multiple of 128 x tp)"
            )
        print(
            f"{grid}\nmodel: {n_params / 1e6:.2f}M parameters, {model_flops_per_token(cfg) / 1e6:.1f} "
            f"MFLOP/token; global batch {config.global_batch} x {config.block_size} tokens; attention "
            f"{config.attention}; peak {peak / 1e9:,.0f} GFLOP/s per rank ({source})"
        )
        os.makedirs(config.out_dir, exist_ok=True)

    return MetricsLog(
        config.out_dir,
        step,
        enabled=log,
        device=grid.device,
        world=grid.world,
        flops_per_token=model_flops_per_token(cfg),
        peak=peak,
        source=source,
        tokens_per_step=config.global_batch * config.block_size,
        log_every=config.log_every,
        tensorboard=config.tensorboard,
    )


class MetricsLog:
    """What the logging rank reports (the others hold no file): a line every log_every steps, and at
    every validation, spike or skipped step; every row in OUT/metrics.jsonl, where the rows after
    the step a run starts from (written before a crash, or before a rollback) are removed so that
    they are redone, not doubled."""

    def __init__(
        self,
        out_dir,
        step,
        *,
        enabled,
        device,
        flops_per_token,
        tokens_per_step,
        world,
        peak,
        source,
        log_every,
        tensorboard=None,
    ):
        self.out_dir, self.enabled, self.device, self.log_every = (
            out_dir,
            enabled,
            device,
            log_every,
        )
        self.flops_per_token, self.tokens_per_step, self.world = (
            flops_per_token,
            tokens_per_step,
            world,
        )
        self.peak, self.source, self.mfu_warned, self.file = peak, source, False, None
        self.tensorboard, self.events = tensorboard, None  # --tensorboard DIR, its SummaryWriter

        reset_peak_memory(device)
        self.reopen(step)

    def reopen(self, step):
        """metrics.jsonl for appending, with the rows after `step` removed."""
        if not self.enabled:
            return
        if self.file:
            self.file.close()
        path = os.path.join(self.out_dir, "metrics.jsonl")
        if os.path.isfile(path):
            keep = []
            for line in open(path).read().splitlines():
                try:
                    if 0 < json.loads(line)["step"] <= step:
                        keep.append(line + "\n")
                except (ValueError, KeyError, TypeError):
                    pass  # a row cut by the crash
            checkpoint.replace_atomically(path, checkpoint.write_text("".join(keep)))
        self.file = open(path, "a")
        if self.tensorboard:  # its events after `step` purged too (TensorBoard drops them)
            if self.events:
                self.events.close()
            self.events = require_tensorboard()(self.tensorboard, purge_step=step + 1)

    def row(self, *, step, loss, lr, grad_norm, skipped, started):
        """A training step's row: throughput, MFU, this interval's peak memory, tokens
        seen (plot's x axis). The step's time runs from `started` (perf_counter) until the device
        has finished its queued work, the optimizer step's included (issue 42 M2)."""
        device_done(self.device)
        tok_s = self.tokens_per_step / (time.perf_counter() - started)
        return dict(
            step=step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            skipped=skipped,
            tok_s=tok_s,
            mfu=mfu(self.flops_per_token, tok_s, self.world, self.peak),
            peak_flops=self.peak,
            mem_gib=peak_memory_gib(self.device),
            tokens=step * self.tokens_per_step,
        )

    def log_validation(self, val):
        """Step 0's validation loss: where the curve starts (~ ln V)."""
        if self.enabled:
            print(f"step     0 val {val:.4f}", flush=True)
            self.write(
                dict(
                    step=0,
                    val_loss=val,
                    mfu=0.0,
                    peak_flops=self.peak,
                    mem_gib=peak_memory_gib(self.device),
                )
            )

    def log_step(self, rec, *, spike):
        if not self.enabled:
            return

        if rec["mfu"] > 1 and not self.mfu_warned:
            self.mfu_warned = True
            print(
                f"warning: MFU {rec['mfu']:.2f} > 1 is impossible: the peak {self.peak / 1e9:,.0f} GFLOP/s "
                f"({self.source}) is wrong; pass the device's real peak with --peak-flops",
                file=sys.stderr,
            )

        finite = not rec["skipped"] and math.isfinite(rec["loss"])
        if rec["step"] % self.log_every == 0 or "val_loss" in rec or spike or not finite:
            val = f" val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
            note = (
                " SKIPPED" + (" (loss spike)" if spike else " (not finite)")
                if rec["skipped"]
                else (" LOSS SPIKE" if spike else "")
            )
            print(
                f"step {rec['step']:5d} loss {rec['loss']:.4f}{val} lr {rec['lr']:.2e} norm {rec['grad_norm']:.3f} "
                f"{rec['tok_s']:,.0f} tok/s mfu {100 * rec['mfu']:.1f}% mem {rec['mem_gib']:.2f} GiB{note}",
                flush=True,
            )
            reset_peak_memory(self.device)  # the next line reports its own interval's peak

        self.write(rec)

    def write(self, rec):
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.events:  # every number of the row, at its step
            for key, value in rec.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.events.add_scalar(key, value, rec["step"])
            self.events.flush()

    def close(self):
        if self.file:
            self.file.close()
        if self.events:
            self.events.close()
