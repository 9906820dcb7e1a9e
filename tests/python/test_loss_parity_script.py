"""The FP8 loss-parity script (bench/drivers/fp8-loss-parity.py) on the CPU: its tiny configuration
for 3 steps in bf16, and in bf16 + FP8 where this moe_engine has the FP8 GroupedMLP; the JSON it
writes. The real run (3000 steps of the full model on a Hopper GPU) is `scripts/gpu fp8-loss`."""

import inspect
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

import moe_engine.torch as me

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SCRIPT = os.path.join(ROOT, "bench", "drivers", "fp8-loss-parity.py")
KEYS = ("device", "command", "steps", "final_loss_bf16", "final_loss_fp8", "relative_difference", "loss_bf16",
        "loss_fp8", "step_time_ms_bf16", "step_time_ms_fp8", "config", "data", "nan_or_inf")
STEPS = 3


def fp8_modules():
    return hasattr(me, "Fp8Recipe") and "fp8_recipe" in inspect.signature(me.GroupedMLP.__init__).parameters


def run(tmp_path, precision):
    prefix = tmp_path / f"parity-{precision}"
    done = subprocess.run([sys.executable, SCRIPT, "--tiny", "--steps", str(STEPS), "--precision", precision,
                           "--device", "cpu", "--out", str(prefix), "--no-check"],
                          capture_output=True, text=True, timeout=300)
    return done, prefix


def check_run(r, precision):
    curve = r[f"loss_{precision}"]
    assert len(curve) == STEPS and all(v is not None and math.isfinite(v) for v in curve)
    assert r["nan_or_inf"][precision] is False
    assert r[f"final_loss_{precision}"] == pytest.approx(curve[-1])  # the last 5% of 3 steps: the last one
    assert r[f"step_time_ms_{precision}"] > 0
    assert curve[0] == pytest.approx(math.log(r["config"]["vocab"]), rel=0.1)  # a fresh model: about log V


def test_bf16_run(tmp_path):
    done, prefix = run(tmp_path, "bf16")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.load(open(f"{prefix}.json"))
    for key in KEYS:
        assert key in r, key
    assert r["steps"] == STEPS and r["command"].split()[0].endswith("fp8-loss-parity.py")
    check_run(r, "bf16")
    assert r["loss_fp8"] is None and r["final_loss_fp8"] is None and r["relative_difference"] is None
    d = r["data"]
    assert "synthetic language" in d["description"]
    # the optimal predictor beats a context-free one, which beats the uniform distribution
    assert 0 < d["entropy_floor_nats"] < d["unigram_entropy_nats"] < d["log_vocab_nats"]
    assert os.path.exists(f"{prefix}.png") or "no PNG written" in done.stdout


def test_both_runs(tmp_path):
    if not fp8_modules():
        pytest.skip("this moe_engine has no FP8 GroupedMLP (moe_engine.torch.Fp8Recipe, GroupedMLP(fp8_recipe=...))")
    done, prefix = run(tmp_path, "both")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.load(open(f"{prefix}.json"))
    for key in KEYS:
        assert r[key] is not None, key
    check_run(r, "bf16")
    check_run(r, "fp8")
    assert r["identical_init"] is True
    assert r["relative_difference"] == pytest.approx(
        abs(r["final_loss_fp8"] - r["final_loss_bf16"]) / r["final_loss_bf16"])
    assert r["relative_difference"] < 0.05  # 3 steps from the same weights on the same data
    assert "PASS" in done.stdout or "FAIL" in done.stdout


def test_fp8_missing_is_a_clear_error(tmp_path):
    if fp8_modules():
        pytest.skip("this moe_engine has the FP8 GroupedMLP")
    done, _ = run(tmp_path, "fp8")
    assert done.returncode != 0 and "no FP8 GroupedMLP" in done.stderr
