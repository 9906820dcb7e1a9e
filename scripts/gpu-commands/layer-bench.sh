#!/usr/bin/env bash
# Usage: scripts/gpu layer-bench [ARGS...]
#
# The whole MoE layer in training (issue 25): moe_engine.torch.MoELayer against a torchtitan-style
# eager layer (bench/drivers/torchtitan_layer.py: torch._grouped_mm, index_add_ combine) and
# Megatron-core's MoELayer without TransformerEngine (bench/drivers/megatron_layer.py; alltoall and
# allgather dispatchers, one rank), same weights and inputs, forward + backward, on the model shapes
# of bench/workloads.json (balanced routing unless --routings says more). Installs the Python package
# (the CUDA build against the machine's torch, as scripts/gpu step-bench), megatron-core from
# .deps/wheels/megatron_core-*.whl when it does not import yet, and, where .deps/wheels has the
# grouped_gemm sources (nv_grouped_gemm-*.tar.gz), builds them so that Megatron's experts are its
# GroupedMLP instead of SequentialMLP (a CUDA build of a few minutes; GROUPED_GEMM=0 skips it). Then
# bench/drivers/layer-bench.py: after a check that every layer agrees with the torchtitan-style one,
# per shape the layers' step times, the per-stage breakdown (router, permute, experts, unpermute) of
# ours and the torchtitan-style layer, peak memory and the speedups. Results:
# $OUT/DATE-layer-GPU.{json,md,png} (the PNG where matplotlib imports), the log in
# $OUT/layer-bench.log. A layer that cannot run (no MoELayer in this moe_engine, no megatron-core) is
# reported as missing and left out of the ratios.
# ARGS go to the script (e.g. --cases qwen3, --routings balanced,heavy, --layers ours,torchtitan,
# --megatron-dispatchers allgather, --iters 50, --no-breakdown).
#
# Environment:
#   INSTALL=0       skip the pip installs (the packages are installed already)
#   GROUPED_GEMM=0  do not build grouped_gemm from .deps/wheels (Megatron's experts: SequentialMLP)
#   MOE_PY          the interpreter whose environment has torch (default: python3)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
py=${MOE_PY:-$(command -v python3)}
pip_flags=(-q --disable-pip-version-check)

# last_match PATTERN...: the last existing path the patterns expand to, or nothing.
last_match() {
  local f found=""
  for f in "$@"; do
    if [ -e "$f" ]; then found=$f; fi
  done
  echo "$found"
}

if [ "${INSTALL:-1}" = 1 ]; then
  install_package "$py" || exit 1
  if ! "$py" -c "import megatron.core" >/dev/null 2>&1; then
    if ls .deps/wheels/megatron_core-*.whl >/dev/null 2>&1; then
      # pip picks this interpreter's wheel (fetch-deps downloads one per CPython); --no-deps: its
      # requirements (torch, numpy, packaging) are the machine's already
      "$py" -m pip install "${pip_flags[@]}" --no-index --find-links .deps/wheels --no-deps \
        "megatron-core==${MEGATRON_CORE_VERSION:-0.16.1}" >>"$OUT/install.log" 2>&1 ||
        echo "note: could not install megatron-core from .deps/wheels (see $OUT/install.log): Megatron-core will be reported missing" >&2
    else
      echo "note: no .deps/wheels/megatron_core-*.whl (scripts/gpu fetch-deps): Megatron-core will be reported missing" >&2
    fi
  fi
  if [ "${GROUPED_GEMM:-1}" = 1 ] && ! "$py" -c "import grouped_gemm" >/dev/null 2>&1; then
    sdist=$(last_match .deps/wheels/nv_grouped_gemm-*.tar.gz .deps/wheels/grouped_gemm-*.tar.gz)
    if [ -n "$sdist" ]; then
      echo "building $sdist for Megatron's GroupedMLP (log: $OUT/grouped-gemm-install.log)"
      TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$(nproc) "$py" -m pip install "${pip_flags[@]}" --no-index \
        --no-build-isolation --no-deps "$sdist" >"$OUT/grouped-gemm-install.log" 2>&1 ||
        echo "note: grouped_gemm did not build (see $OUT/grouped-gemm-install.log): Megatron's experts are SequentialMLP" >&2
    fi
  fi
fi
prefix="$OUT/$(date +%Y-%m-%d)-layer-$(gpu_tag)"
PYTHONUNBUFFERED=1 "$py" bench/drivers/layer-bench.py --device cuda --out "$prefix.json" "$@" 2>&1 |
  tee "$OUT/layer-bench.log"
