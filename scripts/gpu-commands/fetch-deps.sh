#!/usr/bin/env bash
# Run here (not on the GPU machine, which has no package registry): downloads the header-only
# Debian packages the build needs into .deps/debs (git-ignored). Pass `.deps` in the device
# tool's `carry`; scripts/gpu-check unpacks them with dpkg -x.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps/debs
cd .deps/debs
# CLI11 and nlohmann-json are header-only; googletest carries the sources, the fallback when the
# GPU machine has no GoogleTest.
for p in libcli11-dev nlohmann-json3-dev googletest; do
  ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download "$p"
done
ls -la
# The Python build backend for `pip install .` there (the GPU machine has torch, nanobind and pytest
# but no registry): scikit-build-core and what it needs, as wheels (scripts/python-test installs them).
mkdir -p ../wheels
cd ../wheels
python3 -m pip download -q --no-deps -d . scikit-build-core pathspec packaging nanobind
ls -la
