#!/bin/bash
# A/B of the FP8 MLP's GLU passes in one device call: `moe-engine bench mlp --dtype fp8` per case
# with DIR/base's library and DIR's, each side LIB:FUSION (SIDES, default "base:forward
# candidate:forward"), ROUNDS rounds alternating; JSONs to OUTDIR. Correctness first: the FP8 and graph GPU tests with DIR's
# library, then compute-sanitizer (memcheck, racecheck) of the fused-vs-unfused MLP test.
#   bash bench/experiments/fp8_glu_passes_ab.sh DIR OUTDIR [ROUNDS] [CASES...]
# DIR holds moe-engine, moe_engine_gpu_tests, libmoe_engine.so.0.1.0 and base/libmoe_engine.so.0.1.0.
set -u
dir=${1:?DIR}
out=${2:?OUTDIR}
rounds=${3:-2}
shift 3 || shift $#
cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(mixtral-8x7b/balanced deepseek-v3-ep8/balanced qwen3-30b-a3b/balanced
  gpt-oss-120b-ep8/balanced qwen3-30b-a3b-small-batch/balanced)
mkdir -p "$out"
ln -sf libmoe_engine.so.0.1.0 "$dir/libmoe_engine.so.0.1"
ln -sf libmoe_engine.so.0.1.0 "$dir/base/libmoe_engine.so.0.1"
tests="$dir/moe_engine_gpu_tests"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
echo "== correctness (candidate library)"
LD_LIBRARY_PATH=$dir "$tests" --gtest_filter="${TESTS:-*Fp8*:*Graph*}" --gtest_brief=1 2>&1 | tail -15
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck; do
  echo "== $tool"
  LD_LIBRARY_PATH=$dir "$sanitizer" --tool $tool --error-exitcode 3 "$tests" \
    --gtest_filter="${SANITIZE:-GpuFp8Mlp.FusedStepsEqualTheUnfusedOps}" --gtest_brief=1 2>&1 | tail -4
done
for round in $(seq 1 "$rounds"); do
  for c in "${cases[@]}"; do
    layout=blocks:32
    [[ $c == gpt-oss* ]] && layout=pairs
    for side in ${SIDES:-base:forward candidate:forward}; do
      lib=$dir
      [ "${side%%:*}" = base ] && lib=$dir/base
      name="$out/${side/:/-}-${c//\//_}-r$round.json"
      LD_LIBRARY_PATH=$lib "$dir/moe-engine" bench mlp --case "$c" --device cuda:0 --dtype fp8 --no-check --json \
        --glu-layout $layout --iters 20 --fusion "${side#*:}" > "$name" 2> "$name.err" || echo "FAILED: $name"
    done
  done
done
python3 - "$out" <<'EOF'
import glob, json, os, sys
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(f))
    t = d["time_ms"]
    key = (d["case"]["name"], "-".join(os.path.basename(f).split("-")[:2]))
    rows.setdefault(key, []).append((t["forward"]["median"], t["backward"]["median"], t["total"]["median"]))
for (case, side), v in sorted(rows.items()):
    print(f"{case:36s} {side:20s} " + "  ".join(f"{a:.3f}/{b:.3f}/{c:.3f}" for a, b, c in v))
EOF
