#!/usr/bin/env bash
# Usage: scripts/gpu step-bench [ARGS...]
#
# GroupedMLP in a training loop against a torchtitan-style MLP (issue 24): installs the Python
# package (the CUDA build against the machine's torch, as MOE_PY_GPU=1 scripts/python-test does,
# without the test suite), then bench/drivers/step-bench.py over bench/workloads.json. Per case, the
# module in three modes (a: .grad accumulation; b: Megatron's float32 main_grad; c: b with delayed
# wgrad and backward_dw) and the anchor (bench/drivers/torchtitan_mlp.py: torch._grouped_mm, eager
# GLU, autograd), alternated step by step after a check that every mode agrees with the anchor:
# step time, TFLOP/s, peak memory and the ratios to the anchor. Results:
# $OUT/DATE-step-GPU.{json,md,png} (the PNG where matplotlib imports), the log in $OUT/step-bench.log.
# ARGS go to the script (e.g. --cases qwen3, --modes b, --iters 50, --micro-batches 4).
#
# Environment:
#   INSTALL=0   skip the pip install (the package is installed already)
#   MOE_PY      the interpreter whose environment has torch (default: python3)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
py=${MOE_PY:-$(command -v python3)}
if [ "${INSTALL:-1}" = 1 ]; then
  install_package "$py" || exit 1
fi
prefix="$OUT/$(date +%Y-%m-%d)-step-$(gpu_tag)"
PYTHONUNBUFFERED=1 "$py" bench/drivers/step-bench.py --device cuda --out "$prefix.json" "$@" 2>&1 |
  tee "$OUT/step-bench.log"
