#!/usr/bin/env bash
# Usage: scripts/gpu power-probe [CASE [GEMM...]]
#
# Samples SM clock, power and throttle reasons (nvidia-smi, every 50 ms) while our GEMMs and
# torch._grouped_mm run sustained, to tell power-limited clocks from kernel inefficiency: first
# all GEMMs of CASE (ours, then the anchor script), then each GEMM for 3 s each way (ours with
# `bench gemm --min-time-ms 3000`, torch with bench/drivers/torch-sustained.py). Prints the clock
# and power medians per phase; the samples are in $OUT/power.csv.
# CASE defaults to mixtral-8x7b/balanced, GEMM (FC/FORM, e.g. fc1/fwd) to fc2/wgrad.
# Needs the anchor script (scripts/gpu fetch-deps) and PyTorch; builds build-gpu/ if needed.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
case_name=${1:-mixtral-8x7b/balanced}
shift || true
gemms=("${@:-fc2/wgrad}")
find_anchor || exit 1
build_gpu "$OUT/build.log" moe-engine || exit 1
log="$OUT/power.csv"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader -lms 50 >"$log" 2>&1 &
smi=$!
mark() { echo "MARK $(date +%Y/%m/%d\ %H:%M:%S.%3N) $*" >>"$log"; }
sleep 1
mark "ours: $case_name all GEMMs"
build-gpu/tools/moe-engine bench gemm --case "$case_name" >"$OUT/ours.txt" 2>&1
sleep 1
mark "torch anchor: $case_name"
PYTHONUNBUFFERED=1 python3 "$ANCHOR" --workloads bench/workloads.json --cases "$case_name" \
  --out "$OUT/anchor.json" >"$OUT/anchor.log" 2>&1
sleep 1
for gemm in "${gemms[@]}"; do
  mark "ours sustained 3 s: $gemm"
  build-gpu/tools/moe-engine bench gemm --case "$case_name" --gemm "$gemm" --min-time-ms 3000 >>"$OUT/ours.txt" 2>&1
  sleep 1
  mark "torch sustained 3 s: $gemm"
  python3 bench/drivers/torch-sustained.py --workloads bench/workloads.json --case "$case_name" --gemm "$gemm" \
    --seconds 3 >>"$OUT/ours.txt" 2>&1
  sleep 1
done
mark end
kill $smi
cat "$OUT/ours.txt"
python3 - "$log" <<'PY'
import sys
phase, rows = "idle", {}
for line in open(sys.argv[1]):
    if line.startswith("MARK"):
        phase = line.split(" ", 3)[3].strip(); continue
    f = [x.strip() for x in line.split(",")]
    if len(f) < 6: continue
    try:
        clk, pw = float(f[1].split()[0]), float(f[3].split()[0])
    except ValueError:
        continue
    if pw < 200: continue  # idle samples between runs
    rows.setdefault(phase, []).append((clk, pw, f[4], f[5]))
for ph, r in rows.items():
    r.sort()
    n = len(r)
    print(f"{ph[:45]:45s} n={n:4d} sm_clock median {r[n//2][0]:.0f} MHz (min {r[0][0]:.0f}) "
          f"power median {sorted(x[1] for x in r)[n//2]:.0f} W  reasons {sorted(set(x[3] for x in r))[:3]}")
PY
