#!/usr/bin/env bash
# Usage: scripts/gpu dram-bytes 'BUILD_DIR ...' 'CASE:GEMM' ...
#
# DRAM and L2-fabric traffic and the duration of single grouped-GEMM launches (ncu, one pass,
# clocks left alone; the third launch), for each given build directory and GEMM (FC/FORM), e.g.
# scripts/gpu dram-bytes 'build-base build-gpu' 'mixtral-8x7b/balanced:fc2/wgrad'. The builds must
# exist (scripts/gpu ab or check makes them); variables set in the command's environment apply to
# every run.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
if [ $# -lt 2 ]; then
  echo "scripts/gpu dram-bytes: expected 'BUILD_DIR ...' and at least one CASE:GEMM (see --help)" >&2
  exit 2
fi
builds=$1
shift
metrics=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_srcunit_ltcfabric.sum,gpu__time_duration.sum
for spec in "$@"; do
  for b in $builds; do
    printf '%-12s %-40s ' "$b" "$spec"
    ncu --clock-control none --metrics "$metrics" -k regex:grouped_gemm_kernel --launch-skip 2 --launch-count 1 \
      "$b/tools/moe-engine" bench gemm --case "${spec%%:*}" --gemm "${spec#*:}" --min-time-ms 0 --iters 1 \
      --settle-ms 0 --no-check 2>&1 | awk '/dram__bytes_read|dram__bytes_write|ltcfabric|duration/ { printf "%s %s %s  ", $1, $(NF-1), $NF } END { print "" }'
  done
done
