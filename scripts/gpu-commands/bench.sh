#!/usr/bin/env bash
# Usage: scripts/gpu bench [CASE]
#
# The grouped-GEMM suite against the anchors, in one run: ROUNDS rounds (default 3) of (the anchor
# script, then `moe-engine bench gemm --anchor`), alternated because clocks drift within a run;
# both settle the GPU to its steady power state before timing (bench/drivers/anchor-steady.py,
# `bench gemm --settle-ms`). Then the combined report, per GEMM the median over rounds
# (bench/report/gemm-report.py): $OUT/DATE-gemm-GPU.{json,md,png}; the raw rounds and the logs go
# into $OUT/rounds.tgz. CASE (a substring of case names) limits the suite.
# Needs the anchor script (scripts/gpu fetch-deps) and PyTorch; builds build-gpu/ if needed.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
case_filter=${1:-}
find_anchor
build_gpu "$OUT/build.log"
rounds=${ROUNDS:-3}
mkdir -p "$OUT/rounds"
for i in $(seq 1 "$rounds"); do
  run_anchor "$OUT/rounds/anchor-$i.json" "$OUT/anchor.log" "$case_filter"
  build-gpu/tools/moe-engine bench gemm ${case_filter:+--case "$case_filter"} \
    --anchor "$OUT/rounds/anchor-$i.json" --json-out "$OUT/rounds/gemm-$i.json" >>"$OUT/bench.log"
  grep geomean "$OUT/bench.log" | tail -1
done
python3 bench/report/gemm-report.py "$OUT/$(date +%Y-%m-%d)-gemm-$(gpu_tag)" "$OUT"/rounds/gemm-*.json
# The raw rounds and the logs travel as one archive.
mv "$OUT/anchor.log" "$OUT/bench.log" "$OUT/build.log" "$OUT/rounds/"
tar -C "$OUT" -czf "$OUT/rounds.tgz" rounds && rm -rf "$OUT/rounds"
