#!/usr/bin/env bash
# Usage: scripts/gpu mlp-probe CASE...
#
# Per-tile cycle counts of the Hopper kernel (a build with MOE_ENGINE_SM90_PROBE=ON in
# build-probe/: mainloop, epilogue and its steps, per launch) over one fused and one unfused
# forward + backward of each given MLP case, printed in launch order.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
if [ $# -eq 0 ]; then
  echo "scripts/gpu mlp-probe: name at least one case (moe-engine bench --list)" >&2
  exit 2
fi
configure . build-probe -DMOE_ENGINE_SM90_PROBE=ON
cmake --build build-probe -j "$(nproc)" --target moe-engine >"$OUT/probe-build.log" 2>&1
for c in "$@"; do
  layout=blocks:32
  [[ "$c" == gpt-oss* ]] && layout=pairs
  echo "== $c ($layout): launches in order; fused forward + backward, then unfused"
  build-probe/tools/moe-engine bench mlp --case "$c" --iters 1 --warmup 0 --vs-unfused --no-check \
    --glu-layout "$layout" --l2-flush-mb 0 2>&1 | grep '^probe'
done
