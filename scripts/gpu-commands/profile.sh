#!/usr/bin/env bash
# One call on the GPU machine: Nsight Compute profiles of chosen grouped GEMMs (one timed run
# each, clocks left alone). Reports land in $OUT as CSV (details page) plus the raw .ncu-rep files.
#   device tool: run(command="scripts/gpu-profile 'CASE[:FILTER]' ...", carry=[".deps"])
# FILTER names one GEMM, e.g. 'mixtral-8x7b/mild:fc2/fwd'; the third launch (after two warm-ups)
# is profiled.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/profiles"
if [ ! -x build-gpu/tools/moe-engine ] || [ -n "${REBUILD:-}" ]; then
  mkdir -p .deps/root
  for f in .deps/debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" .deps/root; done
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr" >/dev/null
fi
cmake --build build-gpu -j "$(nproc)" --target moe-engine >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
nvidia-smi -q -d CLOCK,POWER,PERFORMANCE >"$OUT/profiles/clocks-before.txt" 2>&1
ncu --query-metrics >"$OUT/profiles/metrics.txt" 2>&1
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
  --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section LaunchStats"
i=0
for spec in "$@"; do
  i=$((i + 1))
  case_name=${spec%%:*}
  filter=""
  [ "$spec" != "$case_name" ] && filter=${spec#*:}
  rep="$OUT/profiles/p$i"
  echo "== $i: $case_name ${filter:-(all GEMMs)}" | tee -a "$OUT/profiles/index.txt"
  ncu --clock-control none -k regex:grouped_gemm_kernel --launch-skip 2 --launch-count 1 $sections -f -o "$rep" \
    build-gpu/tools/moe-engine bench gemm --case "$case_name" ${filter:+--gemm "$filter"} \
    --min-time-ms 0 --iters 1 >"$rep.log" 2>&1 || tail -20 "$rep.log"
  ncu -i "$rep.ncu-rep" --page details --csv >"$rep.csv" 2>/dev/null
  ncu -i "$rep.ncu-rep" --page raw --csv >"$rep-raw.csv" 2>/dev/null
done
nvidia-smi -q -d CLOCK,POWER,PERFORMANCE >"$OUT/profiles/clocks-after.txt" 2>&1
tar -C "$OUT" -czf "$OUT/profiles.tgz" profiles && rm -rf "$OUT/profiles"
ls -la "$OUT"
