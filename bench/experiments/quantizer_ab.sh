#!/bin/bash
# A/B of the FP8 quantizers in one device call: the GPU test binary of DIR run against DIR's
# library and against DIR/base's (the same tests binary, the baseline's kernels), ROUNDS rounds
# alternating, each printing QuantizerBandwidthIsReported's lines. Correctness first: the FP8
# and graph tests with DIR's library first; compute-sanitizer (memcheck, racecheck) of the
# quantizer tests last.
#   bash bench/experiments/quantizer_ab.sh DIR [ROUNDS]
# DIR holds moe_engine_gpu_tests, libmoe_engine.so.0.1.0 and base/libmoe_engine.so.0.1.0.
set -u
dir=${1:?DIR}
rounds=${2:-3}
ln -sf libmoe_engine.so.0.1.0 "$dir/libmoe_engine.so.0.1"
ln -sf libmoe_engine.so.0.1.0 "$dir/base/libmoe_engine.so.0.1"
tests="$dir/moe_engine_gpu_tests"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "== correctness (candidate library)"
LD_LIBRARY_PATH=$dir "$tests" --gtest_filter='*Fp8*:*Graph*' --gtest_brief=1 2>&1 | tail -15
for round in $(seq 1 "$rounds"); do
  for side in base candidate; do
    lib=$dir/base
    [ "$side" = candidate ] && lib=$dir
    echo "== round $round: $side"
    LD_LIBRARY_PATH=$lib "$tests" --gtest_filter=GpuFp8.QuantizerBandwidthIsReported 2>&1 | grep measure
  done
done
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
quant='GpuFp8.Quantize*:Dtypes/GpuFp8Dtypes.Quantize*:GpuFp8Graph.Quantizers*:-GpuFp8.QuantizerBandwidthIsReported'
echo "== memcheck"
LD_LIBRARY_PATH=$dir "$sanitizer" --tool memcheck --error-exitcode 3 "$tests" --gtest_filter="$quant" --gtest_brief=1 2>&1 | tail -6
echo "== racecheck"
LD_LIBRARY_PATH=$dir "$sanitizer" --tool racecheck --error-exitcode 3 "$tests" \
  --gtest_filter='Dtypes/GpuFp8Dtypes.QuantizeRowsAndColumnsBitIdenticalToCpu/bfloat16:GpuFp8.QuantizeStridedInputAndWiderPitch' --gtest_brief=1 2>&1 | tail -6
