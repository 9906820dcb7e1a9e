"""The FP8 benchmark's scripts on the CPU: the report (bench/report/gemm-report.py) on rounds made
from a committed `bench gemm --dtype fp8` result with synthetic anchor columns, and the FP8 anchor
(bench/drivers/fp8-anchor.py --dry-run: its argument layouts and its whole measurement flow with
emulated ops). What needs the GPU is the device run (scripts/gpu bench-fp8)."""

import copy
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
REPORT = os.path.join(ROOT, "bench", "report", "gemm-report.py")
ANCHOR = os.path.join(ROOT, "bench", "drivers", "fp8-anchor.py")
RESULT = os.path.join(ROOT, "bench", "results", "2026-11-24-fp8-gemm-scale-warp-h200.json")


def fp8_round(base, scale):
    """A round as `bench gemm --dtype fp8 --anchor` writes it: the anchor columns derived from our
    times (torch 1.3x, loop 1.2x, dense 0.9x), e2e = GEMM + its quantizer pass."""
    r = copy.deepcopy(base)
    r["ceilings"].update({"fp8_tflops": 1280.0, "roofline_tflops": 1280.0,
                          "fp8_source": "anchor dense_fp8_8192_tflops, same run"})
    r["e2e_includes"] = "fwd + quant_x, dgrad + quant_dy, wgrad alone"
    quant = {}
    for e in r["entries"]:
        e["ms"] *= scale
        if e["gemm"].startswith("quant"):
            quant[(e["case"], e["fc"], e["gemm"])] = e["ms"]
    for e in r["entries"]:
        if not e["in_geomean"]:
            continue
        e.update({"torch_scaled_grouped_mm_ms": 1.3 * e["ms"], "per_expert_loop_ms": 1.2 * e["ms"],
                  "dense_fp8_ms": 0.9 * e["ms"]})
        q = {"fwd": "quant_x", "dgrad": "quant_dy"}.get(e["gemm"])
        e["e2e_ms"] = e["ms"] + (quant[(e["case"], e["fc"], q)] if q else 0.0)
        if e["case"] == "qwen3-30b-a3b/heavy" and e["fc"] == "fc2" and e["gemm"] == "wgrad":
            del e["per_expert_loop_ms"]  # an anchor measurement that could not run
            e["anchor_errors"] = {"fc2_loop_wgrad": "RuntimeError: example"}
    return r


def test_fp8_report_combines_rounds(tmp_path):
    base = json.load(open(RESULT))
    files = []
    for i, scale in enumerate((1.0, 1.02, 0.99)):
        path = tmp_path / f"fp8-gemm-{i}.json"
        path.write_text(json.dumps(fp8_round(base, scale)))
        files.append(str(path))
    prefix = str(tmp_path / "2026-01-01-fp8-gemm-h200")
    done = subprocess.run([sys.executable, REPORT, prefix] + files, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    r = json.load(open(prefix + ".json"))
    assert r["rounds"] == 3 and r["dtype"] == "fp8"
    for key in ("device", "command", "geomean_time_ratio_fp8_vs_bf16", "max_time_ratio_fp8_vs_bf16",
                "min_fp8_tflops_compute_bound", "geomean_speedup_vs_torch_scaled_grouped_mm",
                "geomean_speedup_vs_per_expert_loop", "max_time_ratio_e2e_vs_bf16_compute_bound"):
        assert r[key] is not None, key
    # medians: the 1.0 round is the middle one, so the ratios are the synthetic ones exactly
    assert r["geomean_speedup_vs_torch_scaled_grouped_mm"] == pytest.approx(1.3)
    assert r["min_fraction_of_dense_fp8_compute_bound"] == pytest.approx(0.9)
    e = next(e for e in r["entries"] if e["case"] == "mixtral-8x7b/balanced" and e["fc"] == "fc1" and e["gemm"] == "fwd")
    assert e["ms"] == pytest.approx(next(b["ms"] for b in base["entries"] if b["case"] == e["case"]))
    assert len(e["ms_rounds"]) == 3
    skipped = next(e for e in r["entries"] if e["case"] == "qwen3-30b-a3b/heavy" and e["fc"] == "fc2" and e["gemm"] == "wgrad")
    assert "speedup_vs_per_expert_loop" not in skipped and "fc2_loop_wgrad" in skipped["anchor_errors"]
    # compute-bound forward/dgrad only: the min TFLOP/s comes from mixtral, deepseek or gpt-oss
    cb = [x["tflops"] for x in r["entries"] if x["gemm"] in ("fwd", "dgrad") and x["case"].startswith(("mixtral", "deepseek", "gpt-oss"))]
    assert r["min_fp8_tflops_compute_bound"] == pytest.approx(min(cb))
    md = open(prefix + ".md").read()
    assert "| case | fc | GEMM | fp8 ms | TFLOP/s | bf16 ms | fp8/bf16 | vs scaled_grouped_mm | vs loop" in md
    assert "qwen3-30b-a3b/heavy fc2 wgrad: `fc2_loop_wgrad`: RuntimeError: example" in md


def test_fp8_report_refuses_mixed_rounds(tmp_path):
    base = json.load(open(RESULT))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(fp8_round(base, 1.0)))
    short = fp8_round(base, 1.0)
    short["entries"] = short["entries"][:-1]
    b.write_text(json.dumps(short))
    done = subprocess.run([sys.executable, REPORT, str(tmp_path / "x"), str(a), str(b)], capture_output=True, text=True)
    assert done.returncode != 0 and "timed other GEMMs" in done.stderr


def test_fp8_anchor_dry_run(tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")
    if not hasattr(torch.nn.functional, "ScalingType"):
        pytest.skip(f"torch {torch.__version__} has no torch.nn.functional.ScalingType (block-scaled scaled_mm)")
    out = tmp_path / "anchor.json"
    done = subprocess.run([sys.executable, ANCHOR, "--dry-run", "--cases", "qwen3-30b-a3b-small-batch/heavy",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "dry run passed" in done.stdout
    r = json.load(open(out))
    assert r["format"].startswith("moe-engine fp8 anchor") and "partial" not in r
    for c in r["cases"]:
        for fc in ("fc1", "fc2"):
            for path in ("scaled_grouped_mm", "loop", "dense_fp8"):
                for gemm in ("fwd", "dgrad", "wgrad"):
                    v = c[f"{fc}_{path}_{gemm}_ms"]
                    assert isinstance(v, float) or "error" in v
