"""PyTorch integration: custom ops (``torch.ops.moe_engine.*``), the functional API and the
``GroupedLinear`` / ``GroupedMLP`` modules. See ``ops`` and ``modules`` for the contracts."""

import torch as _torch  # noqa: F401  (fails early with a clear ImportError when PyTorch is missing)

from .modules import GroupedLinear, GroupedMLP, normalize_grouped_keys
from .offload import ActivationOffload, mark_not_offload, no_offload
from .ops import (
    check_errors,
    expert_mlp,
    expert_mlp_backward,
    glu,
    glu_backward,
    glu_text,
    grouped_linear,
    grouped_linear_dbias,
    grouped_linear_dgrad,
    grouped_linear_dscales,
    grouped_linear_wgrad,
    init_device,
)

__all__ = [
    "ActivationOffload",
    "mark_not_offload",
    "no_offload",
    "GroupedLinear",
    "GroupedMLP",
    "check_errors",
    "expert_mlp",
    "expert_mlp_backward",
    "glu",
    "glu_backward",
    "glu_text",
    "grouped_linear",
    "grouped_linear_dbias",
    "grouped_linear_dgrad",
    "grouped_linear_dscales",
    "grouped_linear_wgrad",
    "init_device",
    "normalize_grouped_keys",
]
