#!/bin/bash
# A/B of two builds of the grouped GEMM kernels in one device call: `moe-engine bench gemm` per
# case and GEMM with DIR's library and with DIR/base's, ROUNDS rounds alternating (each run also
# times the bf16 GEMM when --dtype fp8: a same-run reference); JSONs to OUTDIR and a table of the
# medians. Correctness first: the GPU tests matching TESTS (default: FP8 and graph) with DIR's library.
#   bash bench/experiments/gemm_lib_ab.sh DIR OUTDIR ROUNDS 'CASE...' 'GEMM...'
# DIR holds moe-engine, moe_engine_gpu_tests, libmoe_engine.so.0.1.0 and base/libmoe_engine.so.0.1.0.
# Environment: DTYPE (default fp8), MIN_TIME_MS (default 50), SETTLE_MS (default 500), CANDIDATE_ENV
# (assignments for the candidate's runs and tests only, e.g. an A/B of one library's two settings).
# GEMMS 'all' runs every GEMM of a case in one process per side and round (CASES 'all': every case).
set -u
dir=${1:?DIR}
out=${2:?OUTDIR}
rounds=${3:-2}
cases=(${4:?CASES})
gemms=(${5:?GEMMS})
mkdir -p "$out"
ln -sf libmoe_engine.so.0.1.0 "$dir/libmoe_engine.so.0.1"
ln -sf libmoe_engine.so.0.1.0 "$dir/base/libmoe_engine.so.0.1"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
if [ "${TESTS:-*Fp8*:*Graph*}" != none ]; then
  echo "== correctness (candidate library)"
  env ${CANDIDATE_ENV:-} LD_LIBRARY_PATH=$dir "$dir/moe_engine_gpu_tests" --gtest_filter="${TESTS:-*Fp8*:*Graph*}" --gtest_brief=1 2>&1 | tail -8
fi
for round in $(seq 1 "$rounds"); do
  for c in "${cases[@]}"; do
    for g in "${gemms[@]}"; do
      # A null A/B (two libraries, SASS-identical kernels, 2026-11-30) read 0.994 with the candidate always
      # second: the order alternates by round, so that an order effect cancels over even rounds.
      order="base candidate"
      [ $((round % 2)) = 0 ] && order="candidate base"
      for side in $order; do
        lib=$dir side_env=${CANDIDATE_ENV:-}
        [ $side = base ] && lib=$dir/base side_env=
        name="$out/$side-${c//\//_}-${g//\//_}-r$round.json"
        gemm_arg=(--gemm "$g")
        [ "$g" = all ] && gemm_arg=()
        env $side_env LD_LIBRARY_PATH=$lib "$dir/moe-engine" bench gemm --case "$c" "${gemm_arg[@]}" --dtype "${DTYPE:-fp8}" \
          --min-time-ms "${MIN_TIME_MS:-50}" --settle-ms "${SETTLE_MS:-500}" --json-out "$name" \
          > "$name.log" 2>&1 || echo "FAILED: $name"
      done
    done
  done
done
python3 - "$out" <<'PY'
import glob, json, os, sys, statistics
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    side = os.path.basename(f).split("-")[0]
    d = json.load(open(f))
    for e in d["entries"]:
        key = (e["case"], f"{e['fc']}/{e['gemm']}")
        for k in ("ms", "bf16_ms"):
            if k in e:
                rows.setdefault(key, {}).setdefault((side, k), []).append(e[k])
for key, v in sorted(rows.items()):
    cells = "  ".join(f"{s}:{k}=" + "/".join(f"{x:.4f}" for x in xs) for (s, k), xs in sorted(v.items()))
    print(f"{key[0]:36s} {key[1]:12s} {cells}")
PY
