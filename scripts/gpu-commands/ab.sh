#!/usr/bin/env bash
# Same-call A/B of the grouped GEMM benchmark: this tree's build against a baseline tree (and
# variants of this build under environment settings), alternated round by round with the anchor,
# so the machine and its clock state weigh on all alike. Prints and writes $OUT/ab.md.
#   here:   rm -rf .ab-base && mkdir .ab-base && git archive REF | tar -x -C .ab-base
#           mkdir -p .shared && cp ../shared/bench/torch_anchor.py .shared/
#   device: run(command="ROUNDS=2 scripts/gpu-ab [NAME:VAR=VALUE ...] [-- CASE]",   (VAR ARGS: bench arguments)
#               carry=[".deps", ".shared", ".ab-base"])
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/ab"
variants=()
case_filter=
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then case_filter=${2:-}; break; fi
  variants+=("$1"); shift
done
mkdir -p .deps/root
for f in .deps/debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" .deps/root; done
configure() { [ -f "$2/build.ninja" ] || cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr" >/dev/null; }
configure . build-gpu
configure .ab-base build-base
half=$(( $(nproc) / 2 ))
cmake --build build-gpu -j "$half" --target moe-engine >"$OUT/ab/build.log" 2>&1 &
cmake --build build-base -j "$half" --target moe-engine >"$OUT/ab/build-base.log" 2>&1
wait
bench() {  # bench NAME BINARY ROUND [ENV...]  (ARGS="..." in ENV: extra arguments of bench gemm)
  local name=$1 bin=$2 i=$3; shift 3
  local envs=() args=()
  for v in "$@"; do
    if [[ $v == ARGS=* ]]; then read -r -a args <<<"${v#ARGS=}"; else envs+=("$v"); fi
  done
  env "${envs[@]}" "$bin" bench gemm ${case_filter:+--case "$case_filter"} --anchor "$OUT/ab/anchor-$i.json" \
    --json-out "$OUT/ab/$name-$i.json" "${args[@]}" >>"$OUT/ab/bench.log"
}
for i in $(seq 1 "${ROUNDS:-2}"); do
  PYTHONUNBUFFERED=1 python3 scripts/anchor-steady.py .shared/torch_anchor.py --workloads bench/workloads.json \
    ${case_filter:+--cases "$case_filter"} --out "$OUT/ab/anchor-$i.json" >>"$OUT/ab/anchor.log" 2>&1
  bench base build-base/tools/moe-engine "$i"
  bench new build-gpu/tools/moe-engine "$i"
  for v in "${variants[@]}"; do bench "${v%%:*}" build-gpu/tools/moe-engine "$i" "${v#*:}"; done
  python3 scripts/ab-report "$OUT/ab" >"$OUT/ab.md"  # after every round: a cut-off call keeps what it has
done
cat "$OUT/ab.md"
tar -C "$OUT" -czf "$OUT/ab.tgz" ab && rm -rf "$OUT/ab"
