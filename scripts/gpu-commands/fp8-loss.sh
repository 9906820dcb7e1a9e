#!/usr/bin/env bash
# Usage: scripts/gpu fp8-loss [ARGS...]
#
# FP8 loss parity (issue 23): installs the Python package (the CUDA build against the machine's
# torch, as MOE_PY_GPU=1 scripts/python-test does, without the test suite), then trains the same
# small MoE language model (6 layers, 16 experts top-2, synthetic language, 3000 steps) from the
# same seed, initial weights and data in bf16 and with FP8 expert MLPs
# (bench/drivers/fp8-loss-parity.py --precision both): $OUT/DATE-fp8-loss-GPU.{json,png} and
# $OUT/fp8-loss.log. ARGS go to the script (e.g. --steps 1000, --no-check). Fails when a loss is
# NaN/inf or the final losses (mean over the last 5% of steps) differ by more than 1%.
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
prefix="$OUT/$(date +%Y-%m-%d)-fp8-loss-$(gpu_tag)"
PYTHONUNBUFFERED=1 "$py" bench/drivers/fp8-loss-parity.py --precision both --device cuda --out "$prefix" "$@" 2>&1 |
  tee "$OUT/fp8-loss.log"
