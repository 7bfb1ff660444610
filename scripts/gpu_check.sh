#!/usr/bin/env bash
# The day a GPU is lent: one command for the GPU tier and the GPU benchmark, every result in one file.
#
#     bash scripts/gpu_check.sh [OUT]        # OUT default: gpu_check.md (then copy its tables into bench/RESULTS.md)
#
# 1. the machine: GPU name(s), driver, CUDA, torch, the CPU
# 2. the GPU tier: python -m pytest -m gpu (CUDA kernels vs eager, training vs CPU, ZeRO stages, offload,
#    save/resume, compile; the NCCL layouts when >= 2 GPUs are visible)
# 3. bench/bench_gpu.py: GPT-2 124M bf16, sdpa / eager / fused attention, compile off / on: tokens/s, MFU, memory
# Budget: ~9 minutes on one GPU (each part has its own timeout, so one stuck part cannot eat the others').
set -u
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check.md}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset NANOMEGA_DEVICE  # the CPU suite's default; here the GPU is the point
{
  echo "# GPU check, $(date -u +%F)"
  echo
  echo '## Machine'
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi: not found"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  python -c "from nanomega import extension; print(extension.cpu_summary())"
  echo '```'
  echo
  echo '## GPU tier: python -m pytest -m gpu'
  echo '```'
  timeout 360 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tail -40
  echo "exit status: ${PIPESTATUS[0]}"
  echo '```'
  echo
  echo '## Benchmark: python bench/bench_gpu.py'
  timeout 240 python bench/bench_gpu.py --steps 20 2>&1 | tail -30
  echo
  echo "exit status: ${PIPESTATUS[0]}"
} 2>&1 | tee "$OUT"
