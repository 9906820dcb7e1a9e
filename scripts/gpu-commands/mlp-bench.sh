#!/usr/bin/env bash
# One call on the GPU machine: the PyTorch-eager MLP anchor (torch_anchor.py, after anchor-steady's
# settling) and `moe-engine bench mlp --vs-unfused` over the suite's cases in the same run, then the
# combined report (scripts/mlp-report). Layouts: GPT-OSS cases pairs (their checkpoints' layout),
# the others blocks:32 (Megatron's moe_mlp_glu_interleave_size); both run fused.
#   here:        mkdir -p .shared && cp ../shared/bench/torch_anchor.py .shared/
#   device tool: run(command="OUT=$OUT scripts/gpu-mlp-bench [CASE_SUBSTRING]", carry=[".deps", ".shared"])
# ITERS (default 20) timed runs per path and case; FUSION=forward (default) or all; RECOMPUTE=1:
# keep only x (backward recomputes FC1); NO_ANCHOR=1: fused vs unfused only (no anchor, no report).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/raw"
filter=${1:-}
if [ ! -x build-gpu/tools/moe-engine ]; then
  mkdir -p .deps/root
  for f in .deps/debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" .deps/root; done
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr" >/dev/null
fi
cmake --build build-gpu -j "$(nproc)" >"$OUT/raw/build.log" 2>&1
[ -z "${NO_ANCHOR:-}" ] && PYTHONUNBUFFERED=1 python3 scripts/anchor-steady.py .shared/torch_anchor.py --workloads bench/workloads.json \
  ${filter:+--cases "$filter"} --out "$OUT/raw/anchor.json" >"$OUT/raw/anchor.log" 2>&1
iters=${ITERS:-20}
fusion=${FUSION:-forward}  # the fused steps (ExpertMlpSpec::fusion): forward or all
for c in $(build-gpu/tools/moe-engine bench --list | awk 'NR > 1 && $1 != "tiny" {print $1}'); do
  [ -n "$filter" ] && [[ "$c" != *"$filter"* ]] && continue
  layout=blocks:32
  [[ "$c" == gpt-oss* ]] && layout=pairs
  cmd="build-gpu/tools/moe-engine bench mlp --case $c --device cuda:0 --no-check --json --vs-unfused --glu-layout $layout --iters $iters --fusion $fusion ${RECOMPUTE:+--recompute}"
  $cmd >"$OUT/raw/mlp-${c//\//_}.json"
  python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], 'fused %.3f ms, unfused %.3f ms, x%.3f' % (j['time_ms']['total']['median'], j['unfused_time_ms']['total']['median'], j['speedup_vs_unfused']))" "$OUT/raw/mlp-${c//\//_}.json" "$c"
done
[ -n "${NO_ANCHOR:-}" ] && exit 0
date=$(date +%Y-%m-%d)
python3 scripts/mlp-report "$OUT/$date-mlp-h200" "$OUT/raw/anchor.json" "$OUT"/raw/mlp-*.json
tar -C "$OUT" -czf "$OUT/raw.tgz" raw && rm -rf "$OUT/raw"
