#!/usr/bin/env bash
# One call on the GPU machine: samples SM clock, power and throttle reasons (nvidia-smi, 50 ms)
# while our GEMM and torch._grouped_mm run sustained, to tell power-limited clocks from kernel
# inefficiency. Needs build-gpu (scripts/gpu-check) and .shared/torch_anchor.py.
#   device tool: run(command="scripts/gpu-power-probe [CASE [GEMM...]]", carry=[".deps", ".shared"])
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
case_name=${1:-mixtral-8x7b/balanced}
shift || true
gemms=("${@:-fc2/wgrad}")
if [ ! -x build-gpu/tools/moe-engine ]; then
  mkdir -p .deps/root
  for f in .deps/debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" .deps/root; done
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr" >/dev/null
fi
cmake --build build-gpu -j "$(nproc)" --target moe-engine >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
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
PYTHONUNBUFFERED=1 python3 .shared/torch_anchor.py --workloads bench/workloads.json --cases "$case_name" \
  --out "$OUT/anchor.json" >"$OUT/anchor.log" 2>&1
sleep 1
for gemm in "${gemms[@]}"; do
  mark "ours sustained 3 s: $gemm"
  build-gpu/tools/moe-engine bench gemm --case "$case_name" --gemm "$gemm" --min-time-ms 3000 >>"$OUT/ours.txt" 2>&1
  sleep 1
  mark "torch sustained 3 s: $gemm"
  python3 scripts/torch-sustained.py --workloads bench/workloads.json --case "$case_name" --gemm "$gemm" \
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
