#!/usr/bin/env bash
# Usage: scripts/gpu check [--sanitize[=TOOLS] | --sanitize-only[=TOOLS]]
#
# Configures and builds build-gpu/ (ptxas reports each kernel's registers and spills:
# $OUT/ptxas.txt), runs the GPU-labelled tests (a skipped GPU test fails here: it means the GPU
# was not usable), the other tests, `moe-engine check` and `moe-engine bench`. Logs go to $OUT;
# the command ends with one PASS/FAIL line per step and fails if any step failed.
#
# --sanitize[=TOOLS]   then runs every GPU test under compute-sanitizer, tool after tool. TOOLS is a
#                      comma-separated list of memcheck, synccheck and racecheck (default: all
#                      three). Each test runs alone, in its own process, under a time limit; each
#                      tool writes $OUT/sanitize-TOOL.log and prints one summary line. A reported
#                      error, a failed, skipped or timed-out test fails the tool's step.
# --sanitize-only[=TOOLS]  the build and the sanitizers, none of the other steps.
#
# Environment:
#   SANITIZE_FILTER    gtest filter of the GPU tests to sanitize (default: all, '*')
#   SANITIZE_TIMEOUT   seconds per test and tool (default: memcheck and synccheck 900, racecheck
#                      3600; racecheck runs the kernels one shared-memory access at a time)
#   SANITIZE_ARGS      extra compute-sanitizer options, e.g. '--racecheck-report hazard'
set -uo pipefail
. "$(dirname "$0")/lib.sh"

all_tools=(memcheck synccheck racecheck)
tools=()
ordinary=1
for arg in "$@"; do
  case "$arg" in
    --sanitize | --sanitize-only) list=$(IFS=,; echo "${all_tools[*]}") ;;
    --sanitize=* | --sanitize-only=*) list=${arg#*=} ;;
    *)
      echo "scripts/gpu check: unknown argument '$arg' (see scripts/gpu check --help)" >&2
      exit 2
      ;;
  esac
  [[ "$arg" == --sanitize-only* ]] && ordinary=0
  IFS=, read -r -a tools <<<"$list"
  for t in "${tools[@]}"; do
    case "$t" in
      memcheck | synccheck | racecheck) ;;
      *)
        echo "scripts/gpu check: unknown sanitizer tool '$t' (expected memcheck, synccheck or racecheck)" >&2
        exit 2
        ;;
    esac
  done
done

status=()
step() {  # step NAME LOG COMMAND...: runs, logs, records PASS/FAIL
  local name=$1 log=$2
  shift 2
  local t0=$SECONDS
  if "$@" >>"$OUT/$log" 2>&1; then status+=("PASS  $name ($((SECONDS - t0)) s)")
  else status+=("FAIL  $name ($((SECONDS - t0)) s, see $log)"); fi
}

# The GPU tests by full name (Suite.Test), as gtest lists them, less the disabled ones.
gpu_tests() {
  build-gpu/tests/moe_engine_gpu_tests --gtest_list_tests --gtest_filter="${SANITIZE_FILTER:-*}" | awk '
    /^[^ ]/ { suite = $1; next }
    /^  / && $1 !~ /^DISABLED_/ && suite !~ /DISABLED_/ { print suite $1 }'
}

# sanitize TOOL: every selected GPU test under compute-sanitizer TOOL, one process per test.
sanitize() {
  local tool=$1
  local log="$OUT/sanitize-$tool.log" limit tmp rc n t0=$SECONDS
  case "$tool" in
    racecheck) limit=${SANITIZE_TIMEOUT:-3600} ;;
    *) limit=${SANITIZE_TIMEOUT:-900} ;;
  esac
  local tests=() clean=0 errors=0 failed=() flagged=() timed_out=()
  mapfile -t tests < <(gpu_tests)
  : >"$log"
  if [ ${#tests[@]} -eq 0 ]; then
    echo "no GPU test matches '${SANITIZE_FILTER:-*}'" | tee -a "$log"
    status+=("FAIL  compute-sanitizer $tool: no test to run (see sanitize-$tool.log)")
    return
  fi
  tmp=$(mktemp)
  for t in "${tests[@]}"; do
    rc=0
    # shellcheck disable=SC2086  # SANITIZE_ARGS: options, split on spaces
    MOE_TEST_UNDER_SANITIZER=$tool timeout --kill-after=60 "$limit" compute-sanitizer --tool "$tool" --error-exitcode 86 ${SANITIZE_ARGS:-} \
      build-gpu/tests/moe_engine_gpu_tests --gtest_filter="$t" >"$tmp" 2>&1 || rc=$?
    # memcheck/synccheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY: ... (N errors, ...)".
    n=$(sed -n -e 's/.*ERROR SUMMARY: \([0-9][0-9]*\) error.*/\1/p' \
      -e 's/.*RACECHECK SUMMARY: .*(\([0-9][0-9]*\) error.*/\1/p' "$tmp" | tail -1)
    n=${n:-0}
    errors=$((errors + n))
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      timed_out+=("$t")
    elif [ "$rc" -eq 86 ] || [ "$n" -gt 0 ]; then
      flagged+=("$t ($n)")
    elif [ "$rc" -ne 0 ]; then
      failed+=("$t (exit $rc)")
    elif grep -q '^\[  SKIPPED \]' "$tmp"; then
      failed+=("$t (skipped)")
    else
      clean=$((clean + 1))
    fi
    { echo "=== $t: exit $rc, $n errors"; cat "$tmp"; } >>"$log"
  done
  rm -f "$tmp"
  local summary="compute-sanitizer $tool: ${#tests[@]} tests, $clean clean, ${#flagged[@]} with errors ($errors errors),"
  summary+=" ${#failed[@]} failed, ${#timed_out[@]} timed out (limit $limit s per test); $((SECONDS - t0)) s"
  {
    echo "== $summary"
    [ ${#flagged[@]} -eq 0 ] || printf '   errors:    %s\n' "${flagged[@]}"
    [ ${#failed[@]} -eq 0 ] || printf '   failed:    %s\n' "${failed[@]}"
    [ ${#timed_out[@]} -eq 0 ] || printf '   timed out: %s\n' "${timed_out[@]}"
  } | tee -a "$log"
  if [ $clean -eq ${#tests[@]} ]; then status+=("PASS  $summary")
  else status+=("FAIL  $summary (see sanitize-$tool.log)"); fi
}

unpack_deps
{ nvidia-smi; nvcc --version; cmake --version | head -1; compute-sanitizer --version; } >"$OUT/env.txt" 2>&1

step configure build.log cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr" -DMOE_ENGINE_PTXAS_VERBOSE=ON
step build build.log cmake --build build-gpu -j "$(nproc)"
step "moe-engine info" env.txt build-gpu/tools/moe-engine info
if [ $ordinary = 1 ]; then
  step "GPU tests (ctest -L gpu)" ctest.log bash -c \
    "cd build-gpu && ctest -L gpu --no-tests=error --timeout 120 --output-on-failure | tee /dev/stderr | grep -q '(Skipped)' && exit 1 || exit \${PIPESTATUS[0]}"
  step "other tests (ctest -LE gpu)" ctest.log bash -c "cd build-gpu && ctest -LE gpu --no-tests=error --output-on-failure -j $(nproc)"
  step "moe-engine check" bench.txt build-gpu/tools/moe-engine check
  step "moe-engine bench" bench.txt build-gpu/tools/moe-engine bench
  step "moe-engine bench --json" bench.json build-gpu/tools/moe-engine bench --json
fi
if [ ${#tools[@]} -gt 0 ]; then
  if ! command -v compute-sanitizer >/dev/null; then
    status+=("FAIL  compute-sanitizer: not found (it comes with the CUDA toolkit)")
  elif [ ! -x build-gpu/tests/moe_engine_gpu_tests ]; then
    status+=("FAIL  compute-sanitizer: no GPU test binary (build-gpu/tests/moe_engine_gpu_tests)")
  else
    for tool in "${tools[@]}"; do sanitize "$tool"; done
  fi
fi

grep -E "spill|ptxas info *: Used" "$OUT/build.log" | sort | uniq -c | sort -rn | head -20 >"$OUT/ptxas.txt"
echo "== scripts/gpu check summary ($(grep -m1 -o 'NVIDIA [A-Z0-9]*' "$OUT/env.txt" || echo 'no GPU')) =="
if [ $ordinary = 1 ]; then
  tail -4 "$OUT/ctest.log"
  cat "$OUT/bench.txt"
fi
printf '%s\n' "${status[@]}"
! printf '%s\n' "${status[@]}" | grep -q '^FAIL'
