#!/usr/bin/env bash
# Usage: scripts/gpu mlp-bench [CASE]
#
# The expert-MLP suite in one run: the PyTorch-eager MLP anchor (the anchor script, after
# bench/drivers/anchor-steady.py's settling), then per case `moe-engine bench mlp --vs-unfused`
# (fused and unfused alternating run by run), then the combined report
# (bench/report/mlp-report.py): $OUT/DATE-mlp-GPU.{json,md,png}, the raw files in $OUT/raw.tgz.
# GLU layouts: the GPT-OSS cases pairs (their checkpoints' layout), the others blocks:32
# (Megatron's moe_mlp_glu_interleave_size). CASE (a substring of case names) limits the suite.
#
# Environment:
#   ITERS=N       timed runs per path and case (default 20)
#   FUSION=all    also fuse the backward's dGLU (default: forward)
#   RECOMPUTE=1   keep only x (backward recomputes FC1)
#   NO_ANCHOR=1   fused vs unfused only: no anchor, no report (no anchor script needed)
#   ACTIVATION=A  every case with activation A instead of its own (`bench mlp --activation`): srelu
#                 or gelu_tanh (non-gated: FC1 of F rows, no GLU layout), swiglu, clamped_qgeglu.
#                 Fused vs unfused only (the anchor computes the cases' own activations): implies
#                 NO_ANCHOR.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
mkdir -p "$OUT/raw"
filter=${1:-}
[ -z "${ACTIVATION:-}" ] || NO_ANCHOR=1
[ -n "${NO_ANCHOR:-}" ] || find_anchor
build_gpu "$OUT/raw/build.log"
[ -n "${NO_ANCHOR:-}" ] || run_anchor "$OUT/raw/anchor.json" "$OUT/raw/anchor.log" "$filter"
iters=${ITERS:-20}
fusion=${FUSION:-forward}  # the fused steps (ExpertMlpSpec::fusion): forward or all
for c in $(build-gpu/tools/moe-engine bench --list | awk 'NR > 1 && $1 != "tiny" {print $1}'); do
  [ -n "$filter" ] && [[ "$c" != *"$filter"* ]] && continue
  layout=blocks:32
  [[ "$c" == gpt-oss* ]] && layout=pairs
  case ${ACTIVATION:-} in srelu | gelu_tanh) layout=halves ;; esac  # non-gated: no GLU layout
  cmd="build-gpu/tools/moe-engine bench mlp --case $c --device cuda:0 --no-check --json --vs-unfused --glu-layout $layout --iters $iters --fusion $fusion ${RECOMPUTE:+--recompute} ${ACTIVATION:+--activation $ACTIVATION}"
  $cmd >"$OUT/raw/mlp-${c//\//_}.json"
  python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], 'fused %.3f ms, unfused %.3f ms, x%.3f' % (j['time_ms']['total']['median'], j['unfused_time_ms']['total']['median'], j['speedup_vs_unfused']))" "$OUT/raw/mlp-${c//\//_}.json" "$c"
done
[ -n "${NO_ANCHOR:-}" ] && exit 0
python3 bench/report/mlp-report.py "$OUT/$(date +%Y-%m-%d)-mlp-$(gpu_tag)" "$OUT/raw/anchor.json" "$OUT"/raw/mlp-*.json
tar -C "$OUT" -czf "$OUT/raw.tgz" raw && rm -rf "$OUT/raw"
