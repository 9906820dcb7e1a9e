#!/usr/bin/env bash
# Usage: scripts/gpu ab [NAME:VAR=VALUE ...] [-- CASE]
#
# Same-call A/B of the grouped-GEMM benchmark: this tree's build ("new") against a baseline tree
# ("base", in .ab-base/), and optionally variants of this build under environment settings, all
# alternated round by round with the anchor, so that the machine and its clock state weigh on all
# alike. Prints and writes $OUT/ab.md (bench/report/ab-report.py, rewritten after every round, so
# a cut-off run keeps what it has); raw runs and logs in $OUT/ab.tgz.
#
# Before, on the development machine, the baseline tree (carried with .deps):
#   rm -rf .ab-base && mkdir .ab-base && git archive REF | tar -x -C .ab-base
#
#   NAME:VAR=VALUE   a variant: this build run with VAR=VALUE in its environment; VAR=ARGS passes
#                    extra `bench gemm` arguments instead, e.g. "noflush:ARGS=--l2-flush-mb 0"
#   -- CASE          only the cases whose names contain CASE
# Environment: ROUNDS (default 2). Needs the anchor script (scripts/gpu fetch-deps) and PyTorch.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
mkdir -p "$OUT/ab"
variants=()
case_filter=
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then case_filter=${2:-}; break; fi
  variants+=("$1"); shift
done
if [ ! -f .ab-base/CMakeLists.txt ]; then
  echo "scripts/gpu ab: no baseline tree in .ab-base/ (see scripts/gpu ab --help)" >&2
  exit 2
fi
find_anchor
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
  run_anchor "$OUT/ab/anchor-$i.json" "$OUT/ab/anchor.log" "$case_filter"
  bench base build-base/tools/moe-engine "$i"
  bench new build-gpu/tools/moe-engine "$i"
  for v in "${variants[@]}"; do bench "${v%%:*}" build-gpu/tools/moe-engine "$i" "${v#*:}"; done
  python3 bench/report/ab-report.py "$OUT/ab" >"$OUT/ab.md"
done
cat "$OUT/ab.md"
tar -C "$OUT" -czf "$OUT/ab.tgz" ab && rm -rf "$OUT/ab"
