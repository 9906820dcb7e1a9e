"""The README's example runs and trains (the loss at least halves) on every device present."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch)")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_example_trains(device):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_tiny_moe.py"), "--device",
                          device.type, "--steps", "30"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "done" in out.stdout
