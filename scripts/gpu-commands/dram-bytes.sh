#!/usr/bin/env bash
# On the GPU machine: DRAM and L2-fabric traffic of single grouped GEMM launches (ncu, one pass,
# clocks left alone), for each given build, after scripts/gpu-ab or gpu-check built them.
#   device tool: run(command="scripts/gpu-dram-bytes 'build-base build-gpu' CASE:fc1/fwd ...")
# Environment variables given as NAME=VALUE after the builds apply to every run.
set -uo pipefail
cd "$(dirname "$0")/.."
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
