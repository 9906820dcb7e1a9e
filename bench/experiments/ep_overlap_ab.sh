#!/usr/bin/env bash
# Usage (on a machine of 2 or 4 GPUs): bench/experiments/ep_overlap_ab.sh MAIN_WHEEL BRANCH_WHEEL [ROUNDS]
#
# Same-call A/B of the expert-parallel layer (bench/drivers/ep-bench.py at 1 and every available
# P of 2, 4): MAIN_WHEEL's package against BRANCH_WHEEL's, the latter with MOE_ENGINE_EP_OVERLAP=0
# and =1 (the switch of bench/results/experiments/2026-11-29-ep-dx-overlap-h200x2.patch; a package
# without it runs the same code twice), rounds alternated. The wheels are built on the development
# machine from each tree. Prints each variant's step times; results in $OUT/ep-overlap-ab.tgz
# (ep-bench JSON/Markdown and logs per variant and round).
set -u
main_wheel=$1
branch_wheel=$2
rounds=${3:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
work=/tmp/ep-overlap-ab
mkdir -p "$work"
n=$(nvidia-smi -L | grep -c '^GPU')
gpus=1
for p in 2 4; do [ "$p" -le "$n" ] && gpus="$gpus,$p"; done
install() { python3 -m pip install -q --no-index --no-deps --force-reinstall "$1" >/dev/null 2>&1; }
for round in $(seq 1 "$rounds"); do
  install "$main_wheel"
  timeout 170 python3 bench/drivers/ep-bench.py --gpus "$gpus" --iters 12 --out "$work/main-$round.json" \
    >"$work/main-$round.log" 2>&1
  echo "main, round $round: rc=$?"
  install "$branch_wheel"
  for overlap in 0 1; do
    MOE_ENGINE_EP_OVERLAP=$overlap timeout 170 python3 bench/drivers/ep-bench.py --gpus "$gpus" --iters 12 \
      --out "$work/overlap$overlap-$round.json" >"$work/overlap$overlap-$round.log" 2>&1
    echo "branch, overlap $overlap, round $round: rc=$?"
  done
done
python3 - "$work" <<'PY'
import glob, json, sys, collections
rows = collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    variant = f.rsplit("/", 1)[1].rsplit("-", 1)[0]
    for e in json.load(open(f))["entries"]:
        rows[(e["model"], e["gpus"], e["mode"], variant)].append(e["ms"])
for key in sorted(rows):
    print(*key, " ".join(f"{v:.3f}" for v in rows[key]))
PY
tar -czf "$OUT/ep-overlap-ab.tgz" -C /tmp ep-overlap-ab
