"""The anchor of bench/drivers/step-bench.py: a torchtitan-style expert MLP in plain eager PyTorch.

What a torchtitan user writes for grouped experts: packed bf16 parameters w1 ``[G, 2F, H]`` and w2
``[G, H, F]`` (optional biases b1 ``[G, 2F]``, b2 ``[G, H]``), FC1 and FC2 through
``torch._grouped_mm`` with int32 cumulative offsets computed on the device (no host sync), the GLU in
eager ops, the float32 router probabilities applied to the activation (the product cast back to
bf16), and autograd for the whole backward: weight gradients land in ``.grad`` and accumulate there
across micro-batches.

The math is moe_engine.torch.GroupedMLP's (docs/design.md section 3), on the same FC1 row layout, so
one set of weights serves both and their outputs and gradients agree within bf16 rounding:

    y = FC2(act(FC1 x + b1) * p) + p * b2

The GLU layouts alternate blocks of s gate columns and s linear columns among the 2F (``halves``:
s = F; ``blocks:s``; ``pairs``: s = 1). ``swiglu`` is silu(gate) * linear; ``clamped_qgeglu`` is
GPT-OSS's gate.clamp(max=limit) * sigmoid(alpha * gate) * (linear.clamp(-limit, limit) + offset).

Rows must fill the experts exactly (``sum(splits) == T``): ``torch._grouped_mm`` does not define the
rows past the last offset.

``torch._grouped_mm`` has no working backward on the CPU in some PyTorch releases; there
(``use_grouped_mm=False``, which ``grouped_mm_works`` decides) FC1 and FC2 run as a per-expert loop of
matmuls over host-side split sizes, the same math with a host sync. That is for smoke tests only: on
CUDA the anchor always uses ``torch._grouped_mm``.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


def glu_block(layout: str, ffn: int) -> int:
    """s of a GLU layout: the run length of gate (then linear) columns among FC1's 2F outputs."""
    if layout == "halves":
        return ffn
    if layout == "pairs":
        return 1
    if layout.startswith("blocks:"):
        s = int(layout.split(":", 1)[1])
        if s < 1 or ffn % s:
            raise ValueError(f"GLU layout {layout}: ffn {ffn} is not a multiple of {s}")
        return s
    raise ValueError(f"unknown GLU layout '{layout}'; expected halves, pairs or blocks:s")


def grouped_mm_works(device) -> bool:
    """Whether torch._grouped_mm runs forward and backward on `device` (always assumed on CUDA,
    where a failure should be seen, not hidden by a slower fallback)."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    try:
        x = torch.randn(24, 16, dtype=torch.bfloat16, device=device, requires_grad=True)
        w = torch.randn(2, 32, 16, dtype=torch.bfloat16, device=device, requires_grad=True)
        offs = torch.tensor([8, 24], dtype=torch.int32, device=device)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs).sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


class TorchtitanGroupedMLP(nn.Module):
    """G experts' MLP over rows sorted by expert, all in eager PyTorch (see the module docstring)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, *, bias: bool = False,
                 activation: str = "swiglu", glu_layout: str = "halves", limit: float = 7.0,
                 alpha: float = 1.702, offset: float = 1.0, use_grouped_mm: bool = True, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if activation not in ("swiglu", "clamped_qgeglu"):
            raise ValueError(f"unknown activation '{activation}'; expected swiglu or clamped_qgeglu")
        self.activation, self.limit, self.alpha, self.offset = activation, limit, alpha, offset
        self.block = glu_block(glu_layout, ffn)
        self.use_grouped_mm = use_grouped_mm

        def param(shape, fan_in):
            bound = 1.0 / math.sqrt(fan_in)
            return nn.Parameter(torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound))

        self.w1 = param((num_experts, 2 * ffn, hidden), hidden)
        self.b1 = param((num_experts, 2 * ffn), hidden) if bias else None
        self.w2 = param((num_experts, hidden, ffn), ffn)
        self.b2 = param((num_experts, hidden), ffn) if bias else None

    def _grouped_mm(self, x, w, offs):
        """Row block g of x times w[g]^T, for w ``[G, N, K]``."""
        if self.use_grouped_mm:
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        ends = offs.tolist()
        starts = [0] + ends[:-1]
        return torch.cat([x[a:b] @ w[g].transpose(0, 1) for g, (a, b) in enumerate(zip(starts, ends))])

    def _glu(self, h):
        # [T, 2F] -> (gate, linear) as [T, F/s, s] views: the elementwise ops read them in place.
        gate, linear = h.unflatten(-1, (-1, 2, self.block)).unbind(-2)
        if self.activation == "swiglu":
            out = F.silu(gate) * linear
        else:
            gate = gate.clamp(max=self.limit)
            linear = linear.clamp(-self.limit, self.limit)
            out = gate * torch.sigmoid(self.alpha * gate) * (linear + self.offset)
        return out.flatten(-2)

    def forward(self, x, splits, probs):
        """x ``[T, H]`` bf16 sorted by expert, splits ``[G]`` (on x's device, summing to T), probs
        ``[T]`` float32 -> y ``[T, H]``."""
        T = x.shape[0]
        offs = torch.cumsum(splits, 0, dtype=torch.int32)
        h = self._grouped_mm(x, self.w1, offs)
        if self.b1 is not None:
            h = h + self.b1.repeat_interleave(splits, dim=0, output_size=T)
        a = (self._glu(h) * probs[:, None]).to(x.dtype)
        y = self._grouped_mm(a, self.w2, offs)
        if self.b2 is not None:
            y = y + (probs[:, None] * self.b2.repeat_interleave(splits, dim=0, output_size=T)).to(x.dtype)
        return y
