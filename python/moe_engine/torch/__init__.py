"""PyTorch integration: custom ops (``torch.ops.moe_engine.*``), the functional API, the FP8
operands and ops, the ``GroupedLinear`` / ``GroupedMLP`` modules and the whole ``MoELayer``. See ``ops``, ``fp8`` and
``modules`` for the contracts."""

import torch as _torch  # noqa: F401  (fails early with a clear ImportError when PyTorch is missing)

from .fp8 import (
    Fp8Columns,
    Fp8Recipe,
    Fp8Rows,
    Fp8Tensor,
    Fp8Weight,
    expert_mlp_fp8,
    fp8_columns_capacity,
    fp8_scales_pitch,
    grouped_linear_fp8,
    grouped_linear_fp8_dgrad,
    grouped_linear_fp8_wgrad,
    quantize_fp8,
    quantize_fp8_weight,
)
from .layer import MoELayer
from .routing import Dispatched, Router, RouterOutput, combine, dispatch, permuted_rows
from .modules import GroupedLinear, GroupedMLP, normalize_grouped_keys
from .offload import ActivationOffload, mark_as_weight, mark_not_offload, no_offload
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
    "Fp8Columns",
    "Fp8Recipe",
    "Fp8Rows",
    "Fp8Tensor",
    "Fp8Weight",
    "mark_as_weight",
    "mark_not_offload",
    "no_offload",
    "GroupedLinear",
    "GroupedMLP",
    "Dispatched",
    "MoELayer",
    "Router",
    "RouterOutput",
    "combine",
    "dispatch",
    "permuted_rows",
    "check_errors",
    "expert_mlp",
    "expert_mlp_backward",
    "expert_mlp_fp8",
    "fp8_columns_capacity",
    "fp8_scales_pitch",
    "glu",
    "glu_backward",
    "glu_text",
    "grouped_linear",
    "grouped_linear_dbias",
    "grouped_linear_dgrad",
    "grouped_linear_dscales",
    "grouped_linear_fp8",
    "grouped_linear_fp8_dgrad",
    "grouped_linear_fp8_wgrad",
    "grouped_linear_wgrad",
    "init_device",
    "normalize_grouped_keys",
    "quantize_fp8",
    "quantize_fp8_weight",
]
