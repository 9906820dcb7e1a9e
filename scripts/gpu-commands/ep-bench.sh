#!/usr/bin/env bash
# Usage: scripts/gpu ep-bench [ARGS...]
#
# Expert parallelism on a machine of several GPUs (issue 26; `nvidia-h200-x4` or `-x2`): installs the
# Python package (the CUDA build, or MOE_WHEEL), runs the multi-process tests on NCCL
# (tests/python/test_ep.py: the EP layer against the full layer's reference on 2 and 4 GPUs where
# there are that many, graph capture and replay with new routings, no host sync; gloo on the CPU
# too), then bench/drivers/ep-bench.py: weak scaling over 1, 2, 4 ... GPUs (as many as there are) with
# experts and tokens per GPU fixed, the dropless and the fixed-capacity exchange, the all-to-all's
# bandwidth beside NCCL's own in the same run. Results: $OUT/DATE-ep-GPUxN.{json,md}; logs
# $OUT/ep-pytest.log, $OUT/ep-bench.log. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
# ARGS go to ep-bench.py (e.g. --models mixtral-8x7b, --iters 20, --capacity-factor 1.5).
#
# Environment:
#   TESTS=0     skip pytest
#   BENCH=0     skip the benchmark
#   INSTALL=0   skip the package install (installed already)
#   MOE_WHEEL   a prebuilt wheel to install instead of building (see lib.sh)
#   MOE_PY      the interpreter whose environment has torch (default: python3)
set -uo pipefail
. "$(dirname "$0")/lib.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=${MOE_PY:-$(command -v python3)}
status=0
if [ "${INSTALL:-1}" = 1 ]; then install_package "$py" || exit 1; fi
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${TESTS:-1}" = 1 ]; then
  (cd tests/python && MOE_TEST_REQUIRE_CUDA=1 "$py" -m pytest -q -rs test_ep.py) >"$OUT/ep-pytest.log" 2>&1 || status=1
  tail -8 "$OUT/ep-pytest.log"
fi
if [ "${BENCH:-1}" = 1 ]; then
  gpus=1
  for p in 2 4 8; do [ "$p" -le "${n:-1}" ] && gpus="$gpus,$p"; done
  prefix="$OUT/$(date +%Y-%m-%d)-ep-$(gpu_tag)x${n:-1}"
  PYTHONUNBUFFERED=1 "$py" bench/drivers/ep-bench.py --gpus "$gpus" --out "$prefix.json" "$@" 2>&1 |
    tee "$OUT/ep-bench.log" || status=1
fi
exit $status
