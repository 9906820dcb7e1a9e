#!/usr/bin/env bash
# Usage: scripts/gpu profile-vs-torch 'CASE:GEMM' ...
#
# Nsight Compute (--set full, clocks left alone) of our grouped GEMM and of torch._grouped_mm
# (bench/drivers/torch-gemm-once.py) on the same GEMMs, one launch each (the third), then their key
# metrics side by side (bench/report/profile-table.py; ours = oN, torch = tN). GEMM is FC/FORM,
# e.g. 'qwen3-30b-a3b/balanced:fc2/fwd'. Reports, CSVs and the table go to $OUT/pvt.tgz.
# Needs PyTorch; builds build-gpu/ if needed.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
if [ $# -eq 0 ]; then
  echo "scripts/gpu profile-vs-torch: expected at least one 'CASE:GEMM' (see scripts/gpu profile-vs-torch --help)" >&2
  exit 2
fi
mkdir -p "$OUT/pvt"
build_gpu "$OUT/pvt/build.log" moe-engine || exit 1
csvs=()
i=0
for spec in "$@"; do
  i=$((i + 1))
  case_name=${spec%%:*}; gemm=${spec#*:}; fc=${gemm%%/*}; kind=${gemm#*/}
  echo "== $i: $case_name $gemm (ours = o$i, torch = t$i)" | tee -a "$OUT/pvt/index.txt"
  ncu --clock-control none --set full -k regex:grouped_gemm_kernel --launch-skip 2 --launch-count 1 -f -o "$OUT/pvt/o$i" \
    build-gpu/tools/moe-engine bench gemm --case "$case_name" --gemm "$gemm" --min-time-ms 0 --iters 1 --settle-ms 0 \
    >"$OUT/pvt/o$i.log" 2>&1 || tail -5 "$OUT/pvt/o$i.log"
  ncu --clock-control none --set full -k regex:device_kernel --launch-skip 2 --launch-count 1 -f -o "$OUT/pvt/t$i" \
    python3 bench/drivers/torch-gemm-once.py "$case_name" "$fc" "$kind" >"$OUT/pvt/t$i.log" 2>&1 || tail -5 "$OUT/pvt/t$i.log"
  for r in o$i t$i; do
    ncu -i "$OUT/pvt/$r.ncu-rep" --page raw --csv >"$OUT/pvt/$r.csv" 2>/dev/null
    csvs+=("$OUT/pvt/$r.csv")
  done
  grep -h "Function Name\|^  [a-z_]*.*grouped\|Kernel" "$OUT/pvt/o$i.log" | head -2
done
python3 bench/report/profile-table.py "${csvs[@]}" | tee "$OUT/pvt/table.txt"
tar -C "$OUT" -czf "$OUT/pvt.tgz" pvt && rm -rf "$OUT/pvt"
