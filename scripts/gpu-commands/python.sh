#!/usr/bin/env bash
# Usage: scripts/gpu python
#
# The Python package on the GPU: `pip install .` (CUDA build against the machine's torch) and its
# pytest suite on CPU and CUDA (scripts/python-test with MOE_PY_GPU=1; it installs megatron-core
# from .deps/wheels first when scripts/gpu fetch-deps put it there, for test_megatron.py), the example
# (examples/train_tiny_moe.py), and the module-vs-C++ benchmark (bench/drivers/torch-module-bench.py)
# with the PyTorch-eager anchor from the same run when the anchor script is there. Both benchmarks
# measure the bf16 modules and the FP8 ones (GroupedMLP(..., fp8_recipe=Fp8Recipe()), --precision
# both) unless FP8=0. Logs and results go to $OUT (pytest.log, example.log, torch-bench.{json,md,log}).
#
# Environment:
#   TESTS=0     skip pytest and the example (the package is still installed, unless INSTALL=0)
#   INSTALL=0   with TESTS=0: skip the pip install too (the package is installed already)
#   BENCH=0     skip the benchmark (and the anchor); CASES=SUBSTR limits its cases
#   CLI=0       the benchmark without its C++ column (moe-engine bench mlp): no CLI build, faster
#   OFFLOAD=1   also the activation-offload benchmark (bench/drivers/offload-bench.py: $OUT/offload.{json,md}),
#               bf16 and FP8 layers (FP8: the layers that keep the pre-activation), each checked
#               bit-exact against the same step without offload
#   FP8=0       bf16 only in both benchmarks (--precision bf16: their outputs without the FP8 keys)
#   CTEST=1     also the C++ GPU tests (ctest -L gpu) and the C++ offload tests
#   MEMCHECK=1  also the C++ GPU tests (those matching MEMCHECK_FILTER, default all) under
#               compute-sanitizer memcheck, in one process (scripts/gpu check --sanitize runs
#               every tool, test by test)
#   MOE_PY      the interpreter whose environment has torch (default: python3)
set -uo pipefail
. "$(dirname "$0")/lib.sh"
unpack_deps
status=0
export MOE_PY=${MOE_PY:-$(command -v python3)}  # the machine's python, with its torch
# The CLI (the C++ side of the benchmark, and the C++ tests) builds beside the wheel.
# Only the moe-engine target unless the C++ tests run too.
need_cli=0 cli_target=(--target moe-engine)
{ [ "${BENCH:-1}" = 1 ] && [ "${CLI:-1}" = 1 ]; } && need_cli=1
{ [ "${CTEST:-0}" = 1 ] || [ "${MEMCHECK:-0}" = 1 ]; } && need_cli=1 cli_target=()
[ $need_cli = 1 ] && (configure . build-gpu -DMOE_ENGINE_CUDA_ARCHITECTURES=90a &&
  cmake --build build-gpu -j 8 "${cli_target[@]}") >"$OUT/cli-build.log" 2>&1 &
cli=$!
[ $need_cli = 1 ] || cli=""
precision=both
[ "${FP8:-1}" = 1 ] || precision=bf16
if [ "${TESTS:-1}" = 1 ]; then
  MOE_PY_GPU=1 scripts/python-test >"$OUT/pytest.log" 2>&1 || status=1
  tail -25 "$OUT/pytest.log"
  "$MOE_PY" examples/train_tiny_moe.py --device cuda 2>&1 | tee "$OUT/example.log" || status=1
elif [ "${INSTALL:-1}" = 1 ]; then
  install_package "$MOE_PY" || exit 1
fi
[ -z "$cli" ] || wait $cli || { tail -30 "$OUT/cli-build.log"; exit 1; }
if [ "${OFFLOAD:-0}" = 1 ]; then
  "$MOE_PY" bench/drivers/offload-bench.py --precision $precision --out "$OUT/offload.json" 2>&1 |
    tee "$OUT/offload.log" || status=1
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
  anchor=()
  if find_anchor 2>/dev/null; then
    run_anchor "$OUT/anchor.json" "$OUT/anchor.log" "${CASES:-}" && anchor=(--anchor "$OUT/anchor.json") \
      || tail -5 "$OUT/anchor.log"
  else
    echo "no anchor script: the benchmark runs without the PyTorch-eager column"
  fi
  cli_arg=(--cli build-gpu/tools/moe-engine)
  [ "${CLI:-1}" = 1 ] || cli_arg=()
  "$MOE_PY" bench/drivers/torch-module-bench.py "${cli_arg[@]}" ${CASES:+--cases "$CASES"} --precision $precision \
    "${anchor[@]}" --out "$OUT/torch-bench.json" 2>&1 | tee "$OUT/torch-bench.log" || status=1
fi
exit $status
