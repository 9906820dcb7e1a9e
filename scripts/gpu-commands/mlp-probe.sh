#!/usr/bin/env bash
# One call on the GPU machine: per-tile cycle counts of the Hopper kernel (MOE_ENGINE_SM90_PROBE
# build in build-probe: mainloop, epilogue and its steps, per launch) over one fused and one
# unfused forward + backward of each given MLP case.
#   device tool: run(command="scripts/gpu-mlp-probe CASE...", carry=[".deps"])
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT" .deps/root
for f in .deps/debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" .deps/root; done
cmake -S . -B build-probe -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_ENGINE_SM90_PROBE=ON \
  -DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr" >/dev/null
cmake --build build-probe -j "$(nproc)" --target moe-engine >"$OUT/probe-build.log" 2>&1
for c in "$@"; do
  layout=blocks:32
  [[ "$c" == gpt-oss* ]] && layout=pairs
  echo "== $c ($layout): launches in order; fused forward + backward, then unfused"
  build-probe/tools/moe-engine bench mlp --case "$c" --iters 1 --warmup 0 --vs-unfused --no-check \
    --glu-layout "$layout" --l2-flush-mb 0 2>&1 | grep '^probe'
done
