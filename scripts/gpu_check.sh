#!/usr/bin/env bash
# The day a GPU is lent: every phase under one deadline, every result in $OUT (scripts/gpu_check.py).
#
#     OUT=/folder/that/comes/back bash scripts/gpu_check.sh     # default OUT: ./gpu_check_out
#     GPU_CHECK_DEADLINE=480 (seconds, all phases together)      GPU_CHECK_FORCE=1 (CUDA phases on a CPU)
#
# Writes OUT/gpu_check.md (the summary, first and after every phase) and OUT/gpu_check/*.log; nothing
# else in OUT is touched. Nothing is downloaded: the checkout is imported from PYTHONPATH.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset NANOMEGA_DEVICE  # the CPU suite's default; here the GPU is the point

# the interpreter that has torch: $PYTHON, else python3 (a GPU image's), else python
for PY in ${PYTHON:-} python3 python; do
  if command -v "$PY" >/dev/null && "$PY" -c "import torch" 2>/dev/null; then
    break
  fi
  PY=""
done
if [ -z "$PY" ]; then
  echo "gpu_check: no python3 or python here imports torch; set PYTHON=/path/to/python" >&2
  exit 2
fi

"$PY" scripts/gpu_check.py "$@"
rc=$?
# the driver itself killed (e.g. by an outer timeout): its summary is on disk, show it
if [ "$rc" -ge 128 ]; then
  summary="${OUT:-${1:-gpu_check_out}}/gpu_check.md"
  echo "gpu_check: the driver ended by signal $((rc - 128)); its summary so far:"
  cat "$summary" 2>/dev/null
fi
exit "$rc"
