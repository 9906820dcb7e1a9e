#!/usr/bin/env bash
# One call on the GPU machine: ncu (--set full, clocks left alone) of our grouped GEMM and of
# torch._grouped_mm on the same GEMMs, then the key metrics side by side (scripts/profile-table).
#   device tool: run(command="scripts/gpu-profile-vs-torch 'CASE:fc2/fwd' ...", carry=[".deps"])
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/pvt"
if [ ! -x build-gpu/tools/moe-engine ]; then
  mkdir -p .deps/root
  for f in .deps/debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" .deps/root; done
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr" >/dev/null
fi
cmake --build build-gpu -j "$(nproc)" --target moe-engine >"$OUT/pvt/build.log" 2>&1 || { tail -30 "$OUT/pvt/build.log"; exit 1; }
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
    python3 scripts/torch-gemm-once.py "$case_name" "$fc" "$kind" >"$OUT/pvt/t$i.log" 2>&1 || tail -5 "$OUT/pvt/t$i.log"
  for r in o$i t$i; do
    ncu -i "$OUT/pvt/$r.ncu-rep" --page raw --csv >"$OUT/pvt/$r.csv" 2>/dev/null
    csvs+=("$OUT/pvt/$r.csv")
  done
  grep -h "Function Name\|^  [a-z_]*.*grouped\|Kernel" "$OUT/pvt/o$i.log" | head -2
done
python3 scripts/profile-table "${csvs[@]}" | tee "$OUT/pvt/table.txt"
tar -C "$OUT" -czf "$OUT/pvt.tgz" pvt && rm -rf "$OUT/pvt"
