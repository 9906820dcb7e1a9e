#!/usr/bin/env bash
# Usage: scripts/gpu fp8-mlp-bench [CASE]
#
# The FP8 expert-MLP suite in one run: the PyTorch-eager bf16 MLP anchor (the anchor script, after
# bench/drivers/anchor-steady.py's settling), then per case `moe-engine bench mlp --dtype fp8
# --vs-bf16` (the FP8 MLP and our bf16 fused MLP alternating run by run), then the combined report
# (bench/report/fp8-mlp-report.py): $OUT/DATE-fp8-mlp-GPU.{json,md,png}, the raw files in
# $OUT/raw.tgz. GLU layouts as scripts/gpu mlp-bench: pairs for GPT-OSS, blocks:32 otherwise.
# CASE (a substring of case names) limits the suite.
#
# Environment:
#   ITERS=N       timed runs per path and case (default 20)
#   FUSION=none   the FP8 steps unfused (default: forward, the fused FP8 steps where they apply)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
mkdir -p "$OUT/raw"
filter=${1:-}
find_anchor
build_gpu "$OUT/raw/build.log"
run_anchor "$OUT/raw/anchor.json" "$OUT/raw/anchor.log" "$filter"
iters=${ITERS:-20}
fusion=${FUSION:-forward}
for c in $(build-gpu/tools/moe-engine bench --list | awk 'NR > 1 && $1 != "tiny" {print $1}'); do
  [ -n "$filter" ] && [[ "$c" != *"$filter"* ]] && continue
  layout=blocks:32
  [[ "$c" == gpt-oss* ]] && layout=pairs
  cmd="build-gpu/tools/moe-engine bench mlp --case $c --device cuda:0 --dtype fp8 --vs-bf16 --no-check --json --glu-layout $layout --iters $iters --fusion $fusion"
  $cmd >"$OUT/raw/fp8-mlp-${c//\//_}.json"
  python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], 'fp8 %.3f ms, bf16 %.3f ms, x%.3f' % (j['time_ms']['total']['median'], j['bf16_time_ms']['total']['median'], j['time_ratio_fp8_vs_bf16']))" "$OUT/raw/fp8-mlp-${c//\//_}.json" "$c"
done
python3 bench/report/fp8-mlp-report.py "$OUT/$(date +%Y-%m-%d)-fp8-mlp-$(gpu_tag)" "$OUT/raw/anchor.json" "$OUT"/raw/fp8-mlp-*.json
tar -C "$OUT" -czf "$OUT/raw.tgz" raw && rm -rf "$OUT/raw"
