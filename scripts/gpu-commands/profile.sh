#!/usr/bin/env bash
# Usage: scripts/gpu profile 'CASE[:GEMM]' ...
#
# Nsight Compute profiles of chosen grouped GEMMs: for each argument one launch of our kernel (the
# third, after two warm-ups; clocks left alone), with the SpeedOfLight, compute, memory, warp-state,
# scheduler and launch sections. GEMM (FC/FORM, e.g. 'mixtral-8x7b/mild:fc2/fwd') picks one GEMM
# of the case; without it, the third launch of the case's whole `bench gemm` run is profiled.
# Reports go to $OUT/profiles.tgz: per argument the .ncu-rep, its details and raw pages as CSV,
# and the clocks before and after.
# Builds build-gpu/ if needed (REBUILD=1: configure it again).
set -uo pipefail
. "$(dirname "$0")/lib.sh"
if [ $# -eq 0 ]; then
  echo "scripts/gpu profile: expected at least one 'CASE[:GEMM]' (see scripts/gpu profile --help)" >&2
  exit 2
fi
mkdir -p "$OUT/profiles"
build_gpu "$OUT/build.log" moe-engine || exit 1
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
