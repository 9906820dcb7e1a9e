# shellcheck shell=bash
# Helpers shared by the sub-commands of scripts/gpu (sourced by them; not a command). The runner
# has made the repository root the current directory and exported OUT.
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"

# Unpacks the header-only Debian packages of .deps/debs (scripts/gpu fetch-deps) into .deps/root,
# which CMake searches through CMAKE_PREFIX_PATH.
unpack_deps() {
  mkdir -p .deps/root
  local f
  for f in .deps/debs/*.deb; do
    if [ -e "$f" ]; then dpkg -x "$f" .deps/root; fi
  done
}

# install_package PYTHON: `pip install .` into PYTHON's environment as scripts/python-test does with
# MOE_PY_GPU=1: the build tools from .deps/wheels (the GPU machine has no registry), then the
# package, CUDA on, for sm_90a. The log goes to $OUT/install.log; on failure its tail is printed
# and the function returns 1.
# MOE_WHEEL=PATH installs that wheel instead (built elsewhere for this machine's Python and sm_90a,
# e.g. `pip wheel . -Ccmake.define.MOE_ENGINE_CUDA_ARCHITECTURES=90a`, and carried): no build here.
install_package() {
  local py=$1
  local pip_flags=(-q --disable-pip-version-check)
  if [ -n "${MOE_WHEEL:-}" ]; then
    "$py" -m pip install "${pip_flags[@]}" --no-index --no-deps --force-reinstall "$MOE_WHEEL" >"$OUT/install.log" 2>&1 ||
      { tail -30 "$OUT/install.log"; echo "pip install $MOE_WHEEL failed: see $OUT/install.log" >&2; return 1; }
    return 0
  fi
  unpack_deps
  if ! { "$py" -m pip install "${pip_flags[@]}" --no-index --find-links .deps/wheels scikit-build-core nanobind &&
    "$py" -m pip install "${pip_flags[@]}" --no-build-isolation --no-deps -Ccmake.define.MOE_ENGINE_CUDA=ON \
      -Ccmake.define.MOE_ENGINE_CUDA_ARCHITECTURES=90a "-Ccmake.define.CMAKE_PREFIX_PATH=$PWD/.deps/root/usr" .; } \
    >"$OUT/install.log" 2>&1; then
    tail -30 "$OUT/install.log"
    echo "pip install failed: see $OUT/install.log" >&2
    return 1
  fi
}

# configure SOURCE_DIR BUILD_DIR [cmake options...]: a Release build with Ninja against .deps,
# configured once (an existing build.ninja is kept, with its options).
configure() {
  local src=$1 dir=$2
  shift 2
  [ -f "$dir/build.ninja" ] && return 0
  unpack_deps
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$PWD/.deps/root/usr" "$@" \
    >/dev/null
}

# build_gpu LOG [TARGET]: configures build-gpu/ unless it is (REBUILD=1: configure again), then
# builds TARGET (default: everything) with all cores, the output in LOG. On failure prints the
# log's tail and returns 1.
build_gpu() {
  local log=$1 target=${2:-}
  if [ -n "${REBUILD:-}" ]; then rm -f build-gpu/build.ninja; fi
  configure . build-gpu
  if ! cmake --build build-gpu -j "$(nproc)" ${target:+--target "$target"} >"$log" 2>&1; then
    tail -30 "$log"
    echo "build failed: see $log" >&2
    return 1
  fi
}

# find_anchor: sets ANCHOR to the anchor script, torch_anchor.py (measures torch._grouped_mm, the
# per-expert cuBLAS loop and the PyTorch-eager MLP on bench/workloads.json; it lives outside this
# repository, and scripts/gpu fetch-deps copies it into .deps/): $ANCHOR if set, else
# .deps/torch_anchor.py, else .shared/torch_anchor.py. Returns 1, saying so, when there is none.
find_anchor() {
  local a
  for a in "${ANCHOR:-}" .deps/torch_anchor.py .shared/torch_anchor.py; do
    if [ -n "$a" ] && [ -f "$a" ]; then
      ANCHOR=$a
      return 0
    fi
  done
  echo "no anchor script: run scripts/gpu fetch-deps on the development machine (it copies torch_anchor.py" \
    "into .deps/), or set ANCHOR=PATH" >&2
  return 1
}

# run_anchor OUT_JSON LOG [CASE]: the anchor over the suite (or the cases matching CASE), after
# bringing the GPU to its steady power state (bench/drivers/anchor-steady.py).
run_anchor() {
  local json=$1 log=$2 filter=${3:-}
  PYTHONUNBUFFERED=1 "${MOE_PY:-python3}" bench/drivers/anchor-steady.py "$ANCHOR" --workloads bench/workloads.json \
    ${filter:+--cases "$filter"} --out "$json" >>"$log" 2>&1
}

# gpu_tag: the model of GPU 0 in lower case (h100, h200, ...), for result file names.
gpu_tag() {
  local tag
  tag=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null | grep -o -i -m1 '[a-z][0-9]\{2,3\}[a-z]*' | head -1 || true)
  echo "${tag:-gpu}" | tr '[:upper:]' '[:lower:]'
}
