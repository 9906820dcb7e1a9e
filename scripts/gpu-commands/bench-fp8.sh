#!/usr/bin/env bash
# Usage: scripts/gpu bench-fp8 [CASE]
#
# The FP8 grouped-GEMM suite against its anchors, in one run: ROUNDS rounds (default 3) of (the FP8
# anchor bench/drivers/fp8-anchor.py, then `moe-engine bench gemm --dtype fp8 --anchor`), alternated
# because clocks drift within a run; both settle the GPU to its steady power state before timing.
# The anchor times, with PyTorch: torch._scaled_grouped_mm (rowwise FP8), a per-expert loop of
# cuBLAS block-scaled FP8 GEMMs (1x128 / 128x128 scales, what TransformerEngine's Hopper path runs)
# and a dense FP8 GEMM of the same size (the same-run ceiling); `bench gemm --dtype fp8` times our
# FP8 GEMMs beside our bf16 ones and the quantizers. Then the combined report, per GEMM the median
# over rounds (bench/report/gemm-report.py): $OUT/DATE-fp8-gemm-GPU.{json,md,png}; the raw rounds
# and the logs go into $OUT/fp8-rounds.tgz. CASE (a substring of case names) limits the suite.
# Environment: ROUNDS (3), ANCHOR_ARGS (more arguments for fp8-anchor.py, e.g. "--loop-streams 1"),
# GEMM_ARGS (more arguments for bench gemm, e.g. "--min-time-ms 50"), MOE_PY (the Python with
# PyTorch, default python3). Needs PyTorch with torch._scaled_grouped_mm (2.10 or later); builds
# build-gpu/ if needed. Estimated (not yet measured) 3-4 minutes a round on an H200 for the whole
# suite, plus the build; ANCHOR_ARGS="--rep-ms 50" GEMM_ARGS="--min-time-ms 50" shorten it.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
case_filter=${1:-}
py=${MOE_PY:-python3}
if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "bench-fp8: '$py' has no PyTorch that sees a GPU (set MOE_PY to the Python that has)" >&2
  exit 1
fi
build_gpu "$OUT/build.log"
rounds=${ROUNDS:-3}
dir=$OUT/fp8-rounds
mkdir -p "$dir"
# The logs (one per round and program, in $dir) travel with the rounds, also when a round fails.
archive() {
  mv "$OUT/build.log" "$dir/" 2>/dev/null || true
  tar -C "$OUT" -czf "$OUT/fp8-rounds.tgz" fp8-rounds && rm -rf "$dir"
}
trap archive EXIT
for i in $(seq 1 "$rounds"); do
  start=$SECONDS
  # shellcheck disable=SC2086  # ANCHOR_ARGS / GEMM_ARGS are word lists
  if ! PYTHONUNBUFFERED=1 "$py" bench/drivers/fp8-anchor.py --workloads bench/workloads.json \
    ${case_filter:+--cases "$case_filter"} --out "$dir/fp8-anchor-$i.json" ${ANCHOR_ARGS:-} >"$dir/fp8-anchor-$i.log" 2>&1; then
    tail -20 "$dir/fp8-anchor-$i.log" >&2
    echo "bench-fp8: the FP8 anchor failed in round $i (its log: fp8-anchor-$i.log in $OUT/fp8-rounds.tgz)" >&2
    exit 1
  fi
  # shellcheck disable=SC2086
  if ! build-gpu/tools/moe-engine bench gemm --dtype fp8 ${case_filter:+--case "$case_filter"} \
    --anchor "$dir/fp8-anchor-$i.json" --json-out "$dir/fp8-gemm-$i.json" ${GEMM_ARGS:-} >"$dir/fp8-gemm-$i.log" 2>&1; then
    tail -20 "$dir/fp8-gemm-$i.log" >&2
    echo "bench-fp8: bench gemm --dtype fp8 failed in round $i (its log: fp8-gemm-$i.log in $OUT/fp8-rounds.tgz)" >&2
    exit 1
  fi
  echo "round $i ($((SECONDS - start)) s):"
  grep -E "^geomean|^compute-bound|^end to end" "$dir/fp8-gemm-$i.log" || true
done
python3 bench/report/gemm-report.py "$OUT/$(date +%Y-%m-%d)-fp8-gemm-$(gpu_tag)" "$dir"/fp8-gemm-*.json
