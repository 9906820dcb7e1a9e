#!/usr/bin/env bash
# One call on the GPU machine: the anchors (torch._grouped_mm etc.) and `moe-engine bench gemm`
# in the same run, alternated for ROUNDS rounds (default 3), then the combined report. Needs a build from scripts/gpu-check (build-gpu/) or builds
# one, and the anchor script copied here beforehand (the device tool does not carry ../shared):
#   here:        mkdir -p .shared && cp ../shared/bench/torch_anchor.py .shared/
#   device tool: run(command="scripts/gpu-bench [CASE]", carry=[".deps", ".shared"])
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
case_filter=${1:-}
if [ ! -x build-gpu/tools/moe-engine ]; then
  mkdir -p .deps/root
  for f in .deps/debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" .deps/root; done
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr" >/dev/null
fi
cmake --build build-gpu -j "$(nproc)" >"$OUT/build.log" 2>&1
date=$(date +%Y-%m-%d)
rounds=${ROUNDS:-3}
# Clocks drift within a call: alternate the anchor and our run, and combine per-GEMM medians. Both
# settle the GPU to its steady power state before timing (anchor-steady.py, --settle-ms).
mkdir -p "$OUT/rounds"
for i in $(seq 1 "$rounds"); do
  PYTHONUNBUFFERED=1 python3 scripts/anchor-steady.py .shared/torch_anchor.py --workloads bench/workloads.json \
    ${case_filter:+--cases "$case_filter"} --out "$OUT/rounds/anchor-$i.json" >>"$OUT/anchor.log" 2>&1
  build-gpu/tools/moe-engine bench gemm ${case_filter:+--case "$case_filter"} \
    --anchor "$OUT/rounds/anchor-$i.json" --json-out "$OUT/rounds/gemm-$i.json" >>"$OUT/bench.log"
  grep geomean "$OUT/bench.log" | tail -1
done
python3 scripts/bench-report "$OUT/$date-gemm-h200" "$OUT"/rounds/gemm-*.json
# The device tool returns at most 8 files: the raw rounds and the logs travel as one archive.
mv "$OUT/anchor.log" "$OUT/bench.log" "$OUT/build.log" "$OUT/rounds/"
tar -C "$OUT" -czf "$OUT/rounds.tgz" rounds && rm -rf "$OUT/rounds"
