#!/usr/bin/env bash
# One call on the GPU machine: configure, build, run the GPU-labelled tests (and the rest), the
# self-checks and the benchmark; logs go to $OUT. Later work adds its GPU runs here.
#   here:        scripts/fetch-gpu-deps
#   device tool: run(command="scripts/gpu-check [--sanitize]", carry=[".deps"])
# --sanitize also runs the GPU test binary under compute-sanitizer (memcheck).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
sanitize=0
[ "${1:-}" = "--sanitize" ] && sanitize=1
status=()
step() {  # step NAME LOG COMMAND...: runs, logs, records PASS/FAIL
  local name=$1 log=$2
  shift 2
  local t0=$SECONDS
  if "$@" >>"$OUT/$log" 2>&1; then status+=("PASS  $name ($((SECONDS - t0)) s)")
  else status+=("FAIL  $name ($((SECONDS - t0)) s, see $log)"); fi
}

# Header-only dependencies travel as .deb files (scripts/fetch-gpu-deps).
mkdir -p .deps/root
for f in .deps/debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" .deps/root; done
{ nvidia-smi; nvcc --version; cmake --version | head -1; } >"$OUT/env.txt" 2>&1

step configure build.log cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr" -DMOE_ENGINE_PTXAS_VERBOSE=ON
step build build.log cmake --build build-gpu -j "$(nproc)"
step "moe-engine info" env.txt build-gpu/tools/moe-engine info
# On this machine a skipped GPU test is a failure: it means the GPU was not usable.
step "GPU tests (ctest -L gpu)" ctest.log bash -c \
  "cd build-gpu && ctest -L gpu --no-tests=error --timeout 120 --output-on-failure | tee /dev/stderr | grep -q '(Skipped)' && exit 1 || exit \${PIPESTATUS[0]}"
step "other tests (ctest -LE gpu)" ctest.log bash -c "cd build-gpu && ctest -LE gpu --no-tests=error --output-on-failure -j $(nproc)"
step "moe-engine check" bench.txt build-gpu/tools/moe-engine check
step "moe-engine bench" bench.txt build-gpu/tools/moe-engine bench
step "moe-engine bench --json" bench.json build-gpu/tools/moe-engine bench --json
if [ $sanitize = 1 ]; then
  step "compute-sanitizer memcheck (GPU tests)" sanitizer.log \
    compute-sanitizer --tool memcheck --error-exitcode 1 build-gpu/tests/moe_engine_gpu_tests
fi

grep -E "spill|ptxas info *: Used" "$OUT/build.log" | sort | uniq -c | sort -rn | head -20 >"$OUT/ptxas.txt"
echo "== gpu-check summary ($(grep -m1 -o 'NVIDIA [A-Z0-9]*' "$OUT/env.txt" || echo 'no GPU')) =="
tail -4 "$OUT/ctest.log"
cat "$OUT/bench.txt"
printf '%s\n' "${status[@]}"
! printf '%s\n' "${status[@]}" | grep -q '^FAIL'
