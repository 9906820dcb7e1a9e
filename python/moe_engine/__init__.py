"""moe-engine: grouped GEMMs and fused expert MLPs for Mixture-of-Experts training.

The C++ library does the work; this package is a thin skin over it:

- ``moe_engine._C``: the nanobind extension (no PyTorch dependency);
- ``moe_engine.torch``: PyTorch custom ops, the functional API and the ``GroupedLinear`` /
  ``GroupedMLP`` modules with Megatron-LM's training contract (needs ``torch``).
"""

from . import _C

__version__ = _C.build_info()["version"]
DeviceError = _C.DeviceError


def build_info() -> dict:
    """What this build contains: version, CUDA backend and architectures, compilers."""
    return _C.build_info()


def gpus() -> list:
    """The GPUs the process sees (index, name, compute capability, SMs, memory)."""
    found, _note = _C.gpus()
    return found


__all__ = ["DeviceError", "__version__", "build_info", "gpus"]
