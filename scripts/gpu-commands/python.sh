#!/usr/bin/env bash
# One call on the GPU machine for the Python package: `pip install .` (CUDA build) and its pytest
# suite on the GPU (scripts/python-test), the example, the C++ GPU tests (CTEST=1), and the
# module-vs-C++ benchmark (scripts/torch-bench.py) with the PyTorch-eager anchor from the same run
# (BENCH=0 skips both; TESTS=0 skips pytest and the example), and with OFFLOAD=1 the activation
# offload benchmark (scripts/offload-bench.py); MEMCHECK=1 runs the C++ GPU tests (those matching
# MEMCHECK_FILTER, default all) under compute-sanitizer memcheck.
#   here:        scripts/fetch-gpu-deps; mkdir -p .shared && cp ../shared/bench/torch_anchor.py .shared/
#   device tool: run(command="OUT=$OUT scripts/gpu-python", carry=[".deps", ".shared"])
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT" .deps/root
for f in .deps/debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" .deps/root; done
status=0
export MOE_PY=${MOE_PY:-$(command -v python3)}  # the machine's python, with its torch
# The CLI (for the C++ side of the benchmark) builds beside the wheel.
need_cli=0
{ [ "${BENCH:-1}" = 1 ] || [ "${CTEST:-0}" = 1 ] || [ "${MEMCHECK:-0}" = 1 ]; } && need_cli=1
[ $need_cli = 1 ] && (cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr" \
   -DMOE_ENGINE_CUDA_ARCHITECTURES=90a && cmake --build build-gpu -j 8) >/tmp/cli-build.log 2>&1 &
cli=$!
[ $need_cli = 1 ] || cli=""
if [ "${TESTS:-1}" = 1 ]; then
  MOE_PY_GPU=1 scripts/python-test >"$OUT/pytest.log" 2>&1 || status=1
  tail -25 "$OUT/pytest.log"
  "$MOE_PY" examples/train_tiny_moe.py --device cuda 2>&1 | tee "$OUT/example.log" || status=1
fi
[ -z "$cli" ] || wait $cli || { tail -30 /tmp/cli-build.log; exit 1; }
if [ "${OFFLOAD:-0}" = 1 ]; then
  "$MOE_PY" scripts/offload-bench.py --out "$OUT/offload.json" 2>&1 | tee "$OUT/offload.log" || status=1
fi
if [ "${CTEST:-0}" = 1 ]; then
  (cd build-gpu && ctest -L gpu --timeout 120 >"$OUT/ctest-gpu.log" 2>&1) || status=1
  tail -3 "$OUT/ctest-gpu.log"
  build-gpu/tests/moe_engine_gpu_tests --gtest_filter='*Offload*' >"$OUT/offload-cpp.log" 2>&1 || status=1
  grep -E '^\[ offload|FAILED|PASSED' "$OUT/offload-cpp.log"
fi
if [ "${MEMCHECK:-0}" = 1 ]; then
  compute-sanitizer --tool memcheck --error-exitcode 1 build-gpu/tests/moe_engine_gpu_tests \
    --gtest_filter="${MEMCHECK_FILTER:-*}" >"$OUT/memcheck.log" 2>&1 || status=1
  grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/memcheck.log" | tail -5
fi
if [ "${BENCH:-1}" = 1 ]; then
  if [ -e .shared/torch_anchor.py ]; then
    PYTHONUNBUFFERED=1 "$MOE_PY" scripts/anchor-steady.py .shared/torch_anchor.py \
      --workloads bench/workloads.json ${CASES:+--cases "$CASES"} --out /tmp/anchor.json >/tmp/anchor.log 2>&1 \
      && anchor=(--anchor /tmp/anchor.json) || { tail -5 /tmp/anchor.log; anchor=(); }
  fi
  "$MOE_PY" scripts/torch-bench.py --cli build-gpu/tools/moe-engine ${CASES:+--cases "$CASES"} \
    "${anchor[@]}" --out "$OUT/torch-bench.json" 2>&1 | tee "$OUT/torch-bench.log" || status=1
fi
exit $status
