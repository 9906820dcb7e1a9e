"""The benchmark scripts on the CPU:
- the FP8 GEMM report (bench/report/gemm-report.py) on rounds made from a committed `bench gemm
  --dtype fp8` result with synthetic anchor columns, and the FP8 anchor (bench/drivers/fp8-anchor.py
  --dry-run: its argument layouts and its whole measurement flow with emulated ops);
- the offload benchmark (bench/drivers/offload-bench.py --device cpu: an emulated offload) and the
  module benchmark (bench/drivers/torch-module-bench.py --device cpu, no C++ column) on a tiny
  workloads file, bf16 alone (the keys of the committed results) and with the FP8 modules
  (--precision both);
- the FP8 MLP report (bench/report/fp8-mlp-report.py) on inputs rebuilt from its committed H200 result;
- the training-step and whole-layer benchmarks (bench/drivers/step-bench.py, layer-bench.py --device cpu)
  on tiny workloads files.
What needs the GPU is the device runs (scripts/gpu bench-fp8, python, step-bench, layer-bench)."""

import copy
import inspect
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
REPORT = os.path.join(ROOT, "bench", "report", "gemm-report.py")
ANCHOR = os.path.join(ROOT, "bench", "drivers", "fp8-anchor.py")
RESULT = os.path.join(ROOT, "bench", "results", "2026-11-24-fp8-gemm-scale-warp-h200.json")
OFFLOAD = os.path.join(ROOT, "bench", "drivers", "offload-bench.py")
MODULE = os.path.join(ROOT, "bench", "drivers", "torch-module-bench.py")


def fp8_round(base, scale):
    """A round as `bench gemm --dtype fp8 --anchor` writes it: the anchor columns derived from our
    times (torch 1.3x, loop 1.2x, dense 0.9x, dense block-scaled 0.95x, wgrad's 0.8x), e2e = GEMM + its
    quantizer pass."""
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
                  "dense_fp8_ms": 0.9 * e["ms"],
                  "dense_fp8_blockwise_ms": (0.8 if e["gemm"] == "wgrad" else 0.95) * e["ms"]})
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
    assert r["min_fraction_of_dense_fp8_blockwise_compute_bound"] == pytest.approx(0.95)
    assert r["min_fraction_of_dense_fp8_blockwise_wgrad_compute_bound"] == pytest.approx(0.8)
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
    assert "| of dense FP8 | of dense block-scaled |" in md
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


# ---- the offload and module benchmarks on the CPU backend, tiny cases ----

TINY = {"cases": [
    {"name": "tiny/balanced", "experts": 4, "hidden": 128, "ffn": 256, "tokens": 1024, "activation": "swiglu",
     "bias": False, "tokens_per_expert": [300, 0, 500, 224]},
    {"name": "tiny-small-batch/heavy", "experts": 4, "hidden": 128, "ffn": 64, "tokens": 96,
     "activation": "clamped_qgeglu", "bias": True, "tokens_per_expert": [1, 0, 80, 15]},
]}
# The keys of the committed bf16 results (bench/results/2026-11-24-offload-h200.json, *-torch-module-h200.json).
OFFLOAD_KEYS = ("offloaded_layers", "step_ms_offload_off", "step_ms_offload_on", "step_ms_accounting_only",
                "peak_saved_activation_bytes_off", "peak_saved_activation_bytes_on", "peak_memory_ratio",
                "peak_allocated_bytes_off", "peak_allocated_bytes_accounting_only", "peak_allocated_bytes_on",
                "peak_allocated_ratio", "activation_bytes_after_forward_off", "activation_bytes_after_forward_on",
                "after_forward_memory_ratio", "offloaded_bytes", "reloaded_bytes", "link_time_ms",
                "copies_at_link_speed_ms", "step_time_ratio", "step_time_vs_copies_at_link_speed",
                "copy_time_hidden_fraction", "pinned_bytes")
OFFLOAD_TOP = ("device", "torch", "moe_engine", "command", "host_link_GBps", "host_link_d2h_GBps", "host_link_h2d_GBps",
               "cases")
MODULE_KEYS = ("case", "glu_layout", "cpp_ms", "torch_module_ms", "module_over_cpp", "torch_eager_ms",
               "speedup_vs_torch_eager", "flops", "torch_module_tflops")
MODULE_TOP = ("device", "torch", "moe_engine", "command", "iters", "geomean_module_over_cpp", "max_module_over_cpp",
              "cases")
MODULE_FP8_KEYS = ("torch_module_fp8_ms", "time_ratio_fp8_vs_bf16", "torch_module_fp8_tflops", "compute_bound",
                   "peak_memory_bytes_bf16", "peak_memory_bytes_fp8", "peak_memory_ratio_fp8_vs_bf16",
                   "fp8_weight_cache_bytes")


def torch_or_skip():
    return pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")


def fp8_modules_or_skip():
    import moe_engine.torch as me
    if not (hasattr(me, "Fp8Recipe") and "fp8_recipe" in inspect.signature(me.GroupedMLP.__init__).parameters):
        pytest.skip("this moe_engine has no FP8 GroupedMLP (moe_engine.torch.Fp8Recipe, GroupedMLP(fp8_recipe=...))")


def run_driver(tmp_path, script, args, name):
    work = tmp_path / "tiny.json"
    work.write_text(json.dumps(TINY))
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, script, "--device", "cpu", "--workloads", str(work), "--out", str(out)] + args,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.load(open(out)), open(tmp_path / f"{name}.md").read(), done.stdout


OFFLOAD_ARGS = ["--cases", "tiny/balanced", "--layers", "3", "--steps", "1", "--min-bytes", "4096"]


def check_offload_entry(e):
    for key in OFFLOAD_KEYS:
        assert key in e, key
    assert e["offloaded_layers"] == 2 and e["bit_exact"] is True
    # layer 0 is released when layer 2 starts and comes back; layer 1 is still held when backward begins
    assert 0 < e["reloaded_bytes"] < e["offloaded_bytes"]
    assert e["peak_saved_activation_bytes_on"] <= e["peak_saved_activation_bytes_off"]
    if e.get("saves", "pre-activation") == "pre-activation":  # (fp8 entries: pre-activation layers) layer 0's left
        assert e["peak_saved_activation_bytes_on"] < e["peak_saved_activation_bytes_off"]
    assert e["step_time_ratio"] > 0 and e["step_ms_offload_on"] > 0


def test_offload_bench_bf16(tmp_path):
    torch_or_skip()
    r, md, out = run_driver(tmp_path, OFFLOAD, OFFLOAD_ARGS + ["--saves", "pre-activation"], "offload")
    for key in OFFLOAD_TOP:
        assert key in r, key
    assert r["emulated_offload"] is True and r["bit_exact"] is True
    [row] = r["cases"]
    assert (row["case"], row["saves"], row["layers"]) == ("tiny/balanced", "pre-activation", 3)
    check_offload_entry(row)
    assert "fp8" not in row and "step_time_ratio_fp8" not in r and "precisions" not in r
    assert "| tiny/balanced | pre-activation | bf16 | 3 (2) |" in md and "bit-exact" in out


def test_offload_bench_fp8(tmp_path):
    torch_or_skip()
    fp8_modules_or_skip()
    r, md, out = run_driver(tmp_path, OFFLOAD, OFFLOAD_ARGS + ["--precision", "both"], "offload")
    assert r["precisions"] == ["bf16", "fp8"] and r["bit_exact"] is True
    pre, xonly = r["cases"]
    assert (pre["saves"], xonly["saves"]) == ("pre-activation", "x-only")
    check_offload_entry(pre)
    check_offload_entry(xonly)
    assert xonly["fp8"] is None  # the FP8 GroupedMLP has no recompute_fc1
    f = pre["fp8"]
    check_offload_entry(f)
    # FP8 keeps x's columns and the pre-activation in E4M3 (+ scales, + per-expert padding at this size)
    assert f["offloaded_bytes_ratio_vs_bf16"] == pytest.approx(f["offloaded_bytes"] / pre["offloaded_bytes"])
    assert f["offloaded_bytes_ratio_vs_bf16"] < 0.75
    assert r["step_time_ratio_fp8"] == {"tiny/balanced": f["step_time_ratio"]}
    assert r["step_time_ratio_bf16"] == {"tiny/balanced": pre["step_time_ratio"]}
    assert r["offloaded_bytes_ratio_fp8_vs_bf16"] == {"tiny/balanced": f["offloaded_bytes_ratio_vs_bf16"]}
    assert "| tiny/balanced | pre-activation | fp8 | 3 (2) |" in md and "FP8 against bf16" in md
    assert "(pre-activation, fp8)" in out


def test_module_bench(tmp_path):
    torch_or_skip()
    r, md, _ = run_driver(tmp_path, MODULE, ["--iters", "2", "--cases", "tiny/"], "module")
    for key in MODULE_TOP:
        assert key in r, key
    [row] = r["cases"]
    for key in MODULE_KEYS:
        assert key in row, key
    assert row["cpp_ms"] is None and row["torch_module_ms"] > 0 and r["geomean_module_over_cpp"] is None
    assert not any(k in row for k in MODULE_FP8_KEYS if k != "peak_memory_bytes_bf16")
    assert "geomean_time_ratio_fp8_vs_bf16" not in r and "FP8" not in md
    assert "| tiny/balanced | blocks:32 | - |" in md


def test_module_bench_fp8(tmp_path):
    torch_or_skip()
    fp8_modules_or_skip()
    r, md, out = run_driver(tmp_path, MODULE, ["--iters", "2", "--precision", "both"], "module")
    assert r["precisions"] == ["bf16", "fp8"]
    big, small = r["cases"]
    for row in (big, small):
        for key in MODULE_KEYS + MODULE_FP8_KEYS:
            assert key in row, key
        assert row["time_ratio_fp8_vs_bf16"] == pytest.approx(row["torch_module_fp8_ms"] / row["torch_module_ms"])
    assert big["compute_bound"] and not small["compute_bound"]
    # the geomean covers the compute-bound cases only: here the one
    assert r["fp8_compute_bound_cases"] == 1
    assert r["geomean_time_ratio_fp8_vs_bf16"] == pytest.approx(big["time_ratio_fp8_vs_bf16"])
    assert r["max_time_ratio_fp8_vs_bf16"] == pytest.approx(big["time_ratio_fp8_vs_bf16"])
    assert "FP8 / bf16 module time" in out and "tiny-small-batch/heavy (not in the geomean)" in md
    # --md rewrites the same Markdown from the JSON
    again = subprocess.run([sys.executable, MODULE, "--md", str(tmp_path / "module.json")], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == md


FP8_MLP_REPORT = os.path.join(ROOT, "bench", "report", "fp8-mlp-report.py")
FP8_MLP_RESULT = os.path.join(ROOT, "bench", "results", "2026-11-25-fp8-mlp-h200.json")


def test_fp8_mlp_report_reproduces_the_committed_result(tmp_path):
    """bench/report/fp8-mlp-report.py on per-case `bench mlp --dtype fp8 --vs-bf16 --json` files and
    an anchor rebuilt from the committed H200 result: the same acceptance keys, the ratios over the
    compute-bound cases only (the small batch reported, not counted)."""
    committed = json.load(open(FP8_MLP_RESULT))
    anchor = {"device": committed["device"], "torch": committed["torch"], "cases": []}
    paths = []
    for i, e in enumerate(reversed(committed["cases"])):  # any order in: the anchor's order out
        anchor["cases"].append({"case": e["case"], "mlp_eager_ms": e["torch_eager_ms"]})
        phases = lambda prefix: {p: {"median": e[f"{prefix}_{k}ms"], "min": e[f"{prefix}_{k}ms"]}
                                 for p, k in (("forward", "forward_"), ("backward", "backward_"), ("total", ""))}
        r = {"case": {"name": e["case"]}, "glu": e["glu"], "flops": e["flops"], "command": e["command"],
             "fusion_requested": e["fusion_requested"], "time_ms": phases("fp8"), "bf16_time_ms": phases("bf16"),
             "saved_bytes_per_token": e["saved_bytes_per_token"],
             "bf16_saved_bytes_per_token": e["bf16_saved_bytes_per_token"],
             "saved_bytes_ratio_fp8_vs_bf16": e["saved_bytes_ratio_fp8_vs_bf16"]}
        paths.append(str(tmp_path / f"case{i}.json"))
        json.dump(r, open(paths[-1], "w"))
    anchor["cases"].reverse()
    json.dump(anchor, open(tmp_path / "anchor.json", "w"))
    prefix = str(tmp_path / "out")
    subprocess.run([sys.executable, FP8_MLP_REPORT, prefix, str(tmp_path / "anchor.json"), *paths], check=True,
                   capture_output=True)
    got = json.load(open(prefix + ".json"))
    for key in ("device", "geomean_time_ratio_fp8_vs_bf16", "max_time_ratio_fp8_vs_bf16",
                "geomean_speedup_vs_torch_eager", "saved_bytes_ratio_fp8_vs_bf16", "cases_in_ratios"):
        want = pytest.approx(committed[key]) if isinstance(committed[key], float) else committed[key]
        assert got[key] == want, key
    assert [c["case"] for c in got["cases"]] == [c["case"] for c in committed["cases"]]
    assert not any("small-batch" in c for c in got["cases_in_ratios"])
    assert "FP8 / bf16 time: geomean" in open(prefix + ".md").read()


STEP = os.path.join(ROOT, "bench", "drivers", "step-bench.py")
STEP_TOP = ("device", "command", "torch_version", "geomean_speedup_vs_anchor_main_grad",
            "min_speedup_vs_anchor_main_grad", "max_peak_memory_ratio_vs_anchor", "correctness_check", "entries")
STEP_KEYS = ("case", "mode", "mode_name", "ms", "step_ms", "tflops", "peak_bytes", "peak_bytes_above_baseline",
             "anchor_ms", "anchor_peak_bytes", "anchor_peak_bytes_above_baseline", "speedup_vs_anchor",
             "peak_memory_ratio_vs_anchor", "peak_above_baseline_ratio_vs_anchor")


def test_step_bench(tmp_path):
    """bench/drivers/step-bench.py on the CPU backend: both tiny cases (swiglu; clamped_qgeglu with
    biases) x the three modes, its correctness check against the anchor passing first."""
    import math
    torch_or_skip()
    r, md, out = run_driver(tmp_path, STEP, ["--iters", "2", "--warmup", "1"], "step")
    for key in STEP_TOP:
        assert key in r, key
    assert r["micro_batches"] == 2 and list(r["modes"]) == ["a", "b", "c"]
    assert [(e["case"], e["mode"]) for e in r["entries"]] == [(c["name"], m) for c in TINY["cases"] for m in "abc"]
    for e in r["entries"]:
        for key in STEP_KEYS:
            assert key in e, key
        assert math.isfinite(e["speedup_vs_anchor"]) and e["speedup_vs_anchor"] > 0
        assert e["speedup_vs_anchor"] == pytest.approx(e["anchor_ms"] / e["ms"])
        assert e["ms"] == pytest.approx(e["step_ms"] / 2)
        assert e["peak_bytes"] is None and e["peak_memory_ratio_vs_anchor"] is None  # no memory numbers on the CPU
    b = [e["speedup_vs_anchor"] for e in r["entries"] if e["mode"] == "b"]
    assert r["geomean_speedup_vs_anchor_main_grad"] == pytest.approx(math.sqrt(b[0] * b[1]))
    assert r["min_speedup_vs_anchor_main_grad"] == pytest.approx(min(b))
    assert r["max_peak_memory_ratio_vs_anchor"] is None
    check = r["correctness_check"]
    assert check["case"] == "tiny/balanced" and set(check["relative_errors"]) == {e["mode_name"] for e in r["entries"]}
    assert all(0 <= err <= check["tolerance"] for errs in check["relative_errors"].values() for err in errs.values())
    assert "correctness on tiny/balanced" in out and "| tiny-small-batch/heavy | (c) main_grad_delayed_wgrad |" in md
    # --md rewrites the same Markdown from the JSON
    again = subprocess.run([sys.executable, STEP, "--md", str(tmp_path / "step.json")], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == md


# ---- the whole-layer benchmark (bench/drivers/layer-bench.py) on the CPU, tiny shapes ----

LAYER = os.path.join(ROOT, "bench", "drivers", "layer-bench.py")
# E 4, H 128, F 64, top-2 over 128 tokens: balanced, and heavy with an empty expert and one that every
# token uses (the most an expert can get: one row per token).
LAYER_TINY = {"cases": [
    {"name": "tiny/balanced", "model": "tiny", "routing": "balanced", "experts": 4, "hidden": 128, "ffn": 64,
     "tokens": 256, "activation": "swiglu", "bias": False, "note": "128 tokens x top-2",
     "tokens_per_expert": [64, 64, 64, 64]},
    {"name": "tiny/heavy", "model": "tiny", "routing": "heavy", "experts": 4, "hidden": 128, "ffn": 64,
     "tokens": 256, "activation": "swiglu", "bias": False, "note": "128 tokens x top-2",
     "tokens_per_expert": [120, 8, 0, 128]},
]}
LAYER_TOP = ("device", "command", "geomean_speedup_vs_torchtitan_style", "min_speedup_vs_torchtitan_style",
             "min_speedup_vs_megatron_core", "geomean_speedup_vs_megatron_core", "layers", "correctness_check",
             "entries")
LAYER_KEYS = ("case", "tokens", "routed_rows", "topk", "experts", "hidden", "ffn", "layers", "breakdown",
              "routing_check", "speedup_vs_torchtitan_style", "speedup_vs_megatron_core",
              "peak_memory_ratio_vs_torchtitan_style", "megatron_core_best")


def run_layer_bench(tmp_path, args):
    work = tmp_path / "tiny-layer.json"
    work.write_text(json.dumps(LAYER_TINY))
    out = tmp_path / "layer.json"
    done = subprocess.run([sys.executable, LAYER, "--device", "cpu", "--workloads", str(work), "--out", str(out),
                           "--routings", "balanced,heavy", "--iters", "2", "--warmup", "1"] + args,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.load(open(out)), open(tmp_path / "layer.md").read(), done.stdout


def check_layer_entries(r, timed):
    """The entries' common keys; `timed` the layers each entry must have timed."""
    assert [e["case"] for e in r["entries"]] == ["tiny/balanced", "tiny/heavy"]
    for e in r["entries"]:
        for key in LAYER_KEYS:
            assert key in e, key
        assert (e["tokens"], e["routed_rows"], e["topk"]) == (128, 256, 2)
        assert set(timed) <= set(e["layers"])
        for name in e["layers"]:
            assert e["layers"][name]["ms"] > 0 and e["layers"][name]["peak_bytes"] is None  # no memory on the CPU
            # every layer's router picked the intended experts: the case's counts exactly
            rc = e["routing_check"][name]
            counts = next(c["tokens_per_expert"] for c in LAYER_TINY["cases"] if c["name"] == e["case"])
            assert rc["tokens_routed_as_intended"] == 1.0
            assert (rc["min_count"], rc["max_count"]) == (min(counts), max(counts))
        tt = e["breakdown"]["torchtitan_style"]
        assert set(tt) == {"router", "permute", "experts", "unpermute", "sum_ms", "layer_ms"}
        assert sum(tt[s]["fraction"] for s in ("router", "permute", "experts", "unpermute")) == pytest.approx(1.0)
    assert r["entries"][1]["routing_check"]["torchtitan_style"]["max_over_mean_count"] == pytest.approx(2.0)


def test_layer_bench_anchors(tmp_path):
    """The torchtitan-style layer (and Megatron-core's with its allgather dispatcher where megatron-core
    imports) without our layer: the script runs, reports ours as not run, and the ratios are null."""
    torch_or_skip()
    r, md, out = run_layer_bench(tmp_path, ["--layers", "torchtitan,megatron"])
    for key in LAYER_TOP:
        assert key in r, key
    assert "ours" not in r["layers"] and r["geomean_speedup_vs_torchtitan_style"] is None
    assert r["min_speedup_vs_megatron_core"] is None
    assert r["layers"]["megatron_core_alltoall"]["status"].startswith("missing")  # needs CUDA
    timed = ["torchtitan_style"]
    if r["layers"]["megatron_core_allgather"]["status"] == "ran":
        timed.append("megatron_core_allgather")
        assert r["megatron_core"]["experts_class"] == ["SequentialMLP"]
        assert r["correctness_check"]["relative_errors"]["megatron_core_allgather"]["y"] <= 2e-2
    check_layer_entries(r, timed)
    assert "| tiny/heavy | 128 | 4 | 128 | 64 | 2 |" in md
    again = subprocess.run([sys.executable, LAYER, "--md", str(tmp_path / "layer.json")], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == md


def test_layer_bench(tmp_path):
    """All three layers: ours against the anchors (its correctness check passing first)."""
    import math
    torch_or_skip()
    import moe_engine.torch as me
    r, md, out = run_layer_bench(tmp_path, [])
    assert r["layers"]["ours"]["status"] == "ran"
    check_layer_entries(r, ["ours", "torchtitan_style"])
    errs = r["correctness_check"]["relative_errors"]["ours"]
    assert set(errs) == {"y", "dx", "router", "gate", "up", "down"} and max(errs.values()) <= 2e-2
    sp = [e["speedup_vs_torchtitan_style"] for e in r["entries"]]
    assert all(s > 0 for s in sp)
    assert r["min_speedup_vs_torchtitan_style"] == pytest.approx(min(sp))
    assert r["geomean_speedup_vs_torchtitan_style"] == pytest.approx(math.sqrt(sp[0] * sp[1]))
    for e in r["entries"]:
        assert e["speedup_vs_torchtitan_style"] == pytest.approx(e["layers"]["torchtitan_style"]["ms"] /
                                                                 e["layers"]["ours"]["ms"])
        b = e["breakdown"]["ours"]
        assert sum(b[s]["fraction"] for s in ("router", "permute", "experts", "unpermute")) == pytest.approx(1.0)
    if r["layers"]["megatron_core_allgather"]["status"] == "ran":
        assert r["min_speedup_vs_megatron_core"] == pytest.approx(min(e["speedup_vs_megatron_core"]
                                                                      for e in r["entries"]))
    assert "correctness on tiny/balanced" in out and "| tiny/balanced | ours |" in md


# ---- the expert-parallel benchmark (bench/drivers/ep-bench.py) on the CPU: gloo, 1 and 2 ranks ----

EP = os.path.join(ROOT, "bench", "drivers", "ep-bench.py")


def test_ep_bench(tmp_path):
    """Weak scaling over 1 and 2 CPU ranks (gloo) on a tiny shape: every mode ran, the efficiencies are
    the baseline over each entry, the all-to-all numbers are there for the dropless mode at 2 ranks."""
    torch_or_skip()
    work = tmp_path / "tiny-ep.json"
    work.write_text(json.dumps({"cases": [
        {"name": "tiny/balanced", "model": "tiny", "routing": "balanced", "experts": 2, "hidden": 64, "ffn": 32,
         "tokens": 16384, "activation": "swiglu", "bias": False}]}))
    out = tmp_path / "ep.json"
    done = subprocess.run([sys.executable, EP, "--device", "cpu", "--gpus", "1,2", "--models", "tiny", "--workloads",
                           str(work), "--tokens", "16", "--iters", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.load(open(out))
    for key in ("device", "command", "weak_scaling_efficiency_4gpu", "weak_scaling_efficiency_2gpu",
                "min_a2a_fraction_of_same_run_nccl", "entries"):
        assert key in r, key
    assert r["weak_scaling_efficiency_4gpu"] is None  # no 4-rank run here
    got = [(e["gpus"], e["mode"]) for e in r["entries"]]
    assert got == [(1, "baseline"), (1, "dropless"), (1, "capacity"), (2, "dropless"), (2, "capacity")]
    base = r["entries"][0]["ms"]
    for e in r["entries"]:
        assert e["topk"] == 2 and e["experts"] == 2 * e["gpus"] and e["ms"] > 0
        if e["mode"] != "baseline":
            assert e["weak_scaling_efficiency"] == pytest.approx(base / e["ms"])
        if e["mode"] == "capacity":
            assert e["dropped_assignments"] >= 0
    d2 = r["entries"][3]
    assert d2["a2a_dispatch_ms"] > 0 and d2["a2a_fraction_of_peak"] > 0
    assert r["weak_scaling_efficiency_2gpu"] == pytest.approx(d2["weak_scaling_efficiency"])
    assert "| tiny | 2 | dropless |" in open(tmp_path / "ep.md").read()
