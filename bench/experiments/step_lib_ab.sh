#!/bin/bash
# A/B of Python packages (or environment switches) on the module training step, in one device
# call: bench/drivers/step-bench.py per VARIANT, ROUNDS rounds alternating; JSONs to OUTDIR and a
# table of each case and mode's step ms per variant and its speedup vs the same run's anchor.
#   bash bench/experiments/step_lib_ab.sh OUTDIR ROUNDS 'NAME=PYTHONPATH[,VAR=VALUE...] ...' [step-bench args]
# A variant's PYTHONPATH holds its moe_engine package (`pip install --no-deps --target DIR WHEEL`);
# VAR=VALUE pairs are set for its runs only (e.g. MOE_ENGINE_PDL=0).
set -u
out=${1:?OUTDIR}
rounds=${2:?ROUNDS}
variants=(${3:?VARIANTS})
shift 3
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
for round in $(seq 1 "$rounds"); do
  for v in "${variants[@]}"; do
    name=${v%%=*}
    spec=${v#*=}
    IFS=, read -r path envs <<<"$spec"
    env_args=()
    [ -n "${envs:-}" ] && IFS=, read -ra env_args <<<"${spec#*,}"
    echo "== round $round: $name (PYTHONPATH=$path ${env_args[*]:-})"
    env PYTHONPATH="$path" "${env_args[@]}" python3 "$here/drivers/step-bench.py" --device cuda \
      --out "$out/$name-r$round.json" "$@" > "$out/$name-r$round.log" 2>&1 || { echo "FAILED: $name r$round"; tail -5 "$out/$name-r$round.log"; }
  done
done
python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*-r*.json"))):
    variant = os.path.basename(f).rsplit("-r", 1)[0]
    for e in json.load(open(f))["entries"]:
        if e.get("mode") == "anchor" or "ms" not in e:
            continue
        key = (e["case"], e["mode"])
        rows.setdefault(key, {}).setdefault(variant, []).append((e["ms"], e.get("speedup_vs_anchor")))
for (case, mode), per in sorted(rows.items()):
    cells = "  ".join(f"{v}: " + "/".join(f"{ms:.3f}ms {sp or 0:.3f}x" for ms, sp in xs) for v, xs in sorted(per.items()))
    print(f"{case:40s} {mode:28s} {cells}")
PY
