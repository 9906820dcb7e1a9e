#!/usr/bin/env bash
# Usage: scripts/gpu ab [NAME:VAR=VALUE ...] [-- CASE]
#
# Same-call A/B of the benchmarks: this tree's build ("new") against a baseline tree ("base", in
# .ab-base/), alternated round by round so that the machine and its clock state weigh on both
# alike. The GEMM suite (with the anchor each round, and optionally variants of this build under
# environment settings): $OUT/ab.md (bench/report/ab-report.py). The expert-MLP suite (fused
# forward + backward per case, base and new back to back): $OUT/ab-mlp.md
# (bench/report/ab-mlp-report.py). Reports are rewritten after every round, so a cut-off run keeps
# what it has; raw runs and logs in $OUT/ab.tgz.
#
# Before, on the development machine, the baseline tree (carried with .deps):
#   rm -rf .ab-base && mkdir .ab-base && git archive REF | tar -x -C .ab-base
#
#   NAME:VAR=VALUE   a variant: this build run with VAR=VALUE in its environment; VAR=ARGS passes
#                    extra `bench gemm` arguments instead, e.g. "noflush:ARGS=--l2-flush-mb 0"
#   -- CASE          only the cases whose names contain CASE
# Environment: ROUNDS (default 2); SUITES (default "gemm mlp"); MLP_ITERS (default 20). The GEMM
# suite needs the anchor script (scripts/gpu fetch-deps) and PyTorch.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
mkdir -p "$OUT/ab/mlp"
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
suites=${SUITES:-gemm mlp}
if [[ " $suites " == *" gemm "* ]]; then find_anchor; fi
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
mlp_bench() {  # mlp_bench NAME BINARY ROUND: the fused MLP suite (forward fusion, as shipped)
  local name=$1 bin=$2 i=$3 c layout
  for c in $("$bin" bench --list | awk 'NR > 1 && $1 != "tiny" {print $1}'); do
    [ -n "$case_filter" ] && [[ "$c" != *"$case_filter"* ]] && continue
    layout=blocks:32
    [[ "$c" == gpt-oss* ]] && layout=pairs
    "$bin" bench mlp --case "$c" --device cuda:0 --no-check --json --glu-layout "$layout" \
      --iters "${MLP_ITERS:-20}" --fusion forward >"$OUT/ab/mlp/$name-$i-${c//\//_}.json" 2>>"$OUT/ab/bench.log"
  done
}
for i in $(seq 1 "${ROUNDS:-2}"); do
  if [[ " $suites " == *" gemm "* ]]; then
    run_anchor "$OUT/ab/anchor-$i.json" "$OUT/ab/anchor.log" "$case_filter"
    bench base build-base/tools/moe-engine "$i"
    bench new build-gpu/tools/moe-engine "$i"
    for v in "${variants[@]}"; do bench "${v%%:*}" build-gpu/tools/moe-engine "$i" "${v#*:}"; done
    python3 bench/report/ab-report.py "$OUT/ab" >"$OUT/ab.md"
  fi
  if [[ " $suites " == *" mlp "* ]]; then
    # Alternate which build goes first, so neither always runs on a cooler GPU.
    if (( i % 2 )); then mlp_bench base build-base/tools/moe-engine "$i"; mlp_bench new build-gpu/tools/moe-engine "$i"
    else mlp_bench new build-gpu/tools/moe-engine "$i"; mlp_bench base build-base/tools/moe-engine "$i"; fi
    python3 bench/report/ab-mlp-report.py "$OUT/ab/mlp" >"$OUT/ab-mlp.md"
  fi
done
[ -f "$OUT/ab.md" ] && cat "$OUT/ab.md"
[ -f "$OUT/ab-mlp.md" ] && cat "$OUT/ab-mlp.md"
tar -C "$OUT" -czf "$OUT/ab.tgz" ab && rm -rf "$OUT/ab"
