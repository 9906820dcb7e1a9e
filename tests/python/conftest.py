"""pytest setup: the torch suites skip (each module says why) where PyTorch is not installed;
tests run on the CPU backend and, where a GPU is visible, on CUDA too (MOE_TEST_REQUIRE_CUDA=1
makes a missing GPU an error, for the GPU machine)."""

import os

import pytest

try:
    import torch

    HAVE_TORCH = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TORCH = False

def pytest_report_header(config):
    if not HAVE_TORCH:
        return "moe_engine: PyTorch is not installed: the torch suites are skipped (pip install torch)"
    return f"moe_engine: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"


def pytest_collection_modifyitems(config, items):
    if not HAVE_TORCH:
        return
    if os.environ.get("MOE_TEST_REQUIRE_CUDA") == "1" and not torch.cuda.is_available():
        raise pytest.UsageError("MOE_TEST_REQUIRE_CUDA=1 but torch sees no GPU")


def devices():
    if not HAVE_TORCH:
        return []
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=devices())
def device(request):
    return torch.device(request.param)


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda")
