#!/usr/bin/env bash
# Usage: scripts/gpu fetch-deps
#
# Runs on the development machine, not on the GPU machine (which has no package registry): puts
# into .deps/ (git-ignored) what the GPU machine needs and cannot download, so that copying the
# repository with .deps is enough there:
#   .deps/debs/            header-only Debian packages of the build (CLI11, nlohmann-json) and
#                          GoogleTest's sources, unpacked there with dpkg -x
#   .deps/wheels/          the Python build backend for `pip install .` (scikit-build-core and what
#                          it needs, nanobind), installed there by scripts/python-test
#   .deps/wheels/          also megatron-core (MEGATRON_CORE_VERSION, default 0.16.1) for CPython
#                          3.10-3.13 and packaging, its one dependency besides torch and numpy:
#                          scripts/python-test installs them there (--no-index) for
#                          tests/python/test_megatron.py
#   .deps/wheels/          also the sources of nv-grouped-gemm (GROUPED_GEMM_VERSION, default
#                          1.1.4.post8), which Megatron-core's GroupedMLP experts need without
#                          TransformerEngine: scripts/gpu layer-bench builds them on the GPU machine.
#                          Fetched from PyPI's JSON API: `pip download` runs its setup.py, which
#                          needs a GPU
#   .deps/torch_anchor.py  the anchor script (times torch._grouped_mm, the per-expert cuBLAS loop
#                          and the PyTorch-eager MLP on bench/workloads.json), which lives outside
#                          this repository: copied from ANCHOR_SRC (default:
#                          ../shared/bench/torch_anchor.py) when it exists
# Packages already downloaded are kept; the anchor script is copied again.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .deps/debs .deps/wheels
(
  cd .deps/debs
  for p in libcli11-dev nlohmann-json3-dev googletest; do
    ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download "$p"
  done
  ls -la
)
(
  cd .deps/wheels
  python3 -m pip download -q --no-deps -d . scikit-build-core pathspec packaging nanobind
  # megatron-core ships one wheel per CPython (a small C++ helper); the GPU machine's is unknown.
  for v in 3.10 3.11 3.12 3.13; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$v" \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d . \
      "megatron-core==${MEGATRON_CORE_VERSION:-0.16.1}"
  done
  gg=${GROUPED_GEMM_VERSION:-1.1.4.post8}
  ls nv_grouped_gemm-"$gg".tar.gz >/dev/null 2>&1 || python3 - "$gg" <<'PY'
import json, sys, urllib.request
version = sys.argv[1]
meta = json.load(urllib.request.urlopen("https://pypi.org/pypi/nv-grouped-gemm/json", timeout=60))
sdist = next(f for f in meta["releases"][version] if f["packagetype"] == "sdist")
urllib.request.urlretrieve(sdist["url"], sdist["filename"])
PY
  ls -la
)
anchor=${ANCHOR_SRC:-../shared/bench/torch_anchor.py}
if [ -f "$anchor" ]; then
  cp "$anchor" .deps/torch_anchor.py
  echo "anchor script: $anchor -> .deps/torch_anchor.py"
else
  echo "note: no anchor script at $anchor (set ANCHOR_SRC): bench, mlp-bench, ab and power-probe need it"
fi
