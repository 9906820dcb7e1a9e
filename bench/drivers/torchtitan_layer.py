"""An anchor of bench/drivers/layer-bench.py: a torchtitan-style MoE layer (router, permute, experts,
unpermute) in plain eager PyTorch, as a torchtitan user writes it for one GPU.

    route     logits = x W_r^T in the model dtype (nn.Linear, no bias), then float32; softmax over
              the E experts; top-k; the k probabilities divided by their sum (norm_topk_prob);
              counts per expert by torch.histc on the device (fixed-size output: no host sync)
    dispatch  a stable argsort of the flattened [T, k] expert indices: rows in expert order, ties in
              (token, slot) order; x's rows gathered by index_select; the probabilities in the same
              order
    experts   h = x_e w1[e] (w1 ``[E, H, 2F]``, SwiGLU in the halves layout: gate columns first),
              a = silu(gate) * up * p, cast to the model dtype (Megatron's place for the router
              probability: on the activation, before FC2), y_e = a w2[e] (w2 ``[E, F, H]``); both
              GEMMs one torch._grouped_mm over all experts with int32 cumulative offsets computed
              on the device
    combine   index_add_ of the k rows of every token into a float32 ``[T, H]``, cast to the model
              dtype once at the end

Backward is autograd's throughout; the router's weight gets its gradient through the probabilities.
Forward is exactly ``combine(experts(*dispatch(x, route(x))))``, and the four stages are methods so
the benchmark can time each alone.

torch._grouped_mm needs no padding here: in bf16 it takes any non-decreasing int32 offsets (groups
may be empty or of any length; the rows past the last offset are left undefined, which cannot happen
as the offsets end at T k). Its constraints are on the operands: 2-D/3-D, row- or column-major, the
leading stride a multiple of 16 bytes (H and 2F multiples of 8 in bf16), and the offsets int32,
contiguous and on the device. (Padding each group to 16 rows is a constraint of the FP8 / MXFP8
grouped GEMMs, not of this one.) Where torch._grouped_mm has no working backward (the CPU in some
releases; ``use_grouped_mm=False``, which torchtitan_mlp.grouped_mm_works decides) the experts run as
a per-expert loop of matmuls over host-side split sizes: smoke tests only, never on CUDA.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Routing:
    probs: torch.Tensor    # [T, k] float32, normalized over the k choices
    indices: torch.Tensor  # [T, k] int64
    counts: torch.Tensor   # [E] int64, on the device


@dataclass
class Dispatched:
    x: torch.Tensor        # [T k, H] rows in expert order
    probs: torch.Tensor    # [T k] float32, same order
    splits: torch.Tensor   # [E] int64 (the routing's counts)
    token: torch.Tensor    # [T k] int64: the token each row came from
    num_tokens: int


class TorchtitanMoELayer(nn.Module):
    """E experts, top-k, SwiGLU, no biases (see the module docstring)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, topk: int, *, norm_topk_prob: bool = True,
                 use_grouped_mm: bool = True, device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk {topk} must be in [1, {num_experts}]")
        self.num_experts, self.hidden, self.ffn, self.topk = num_experts, hidden, ffn, topk
        self.norm_topk_prob, self.use_grouped_mm = norm_topk_prob, use_grouped_mm
        self.router = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)

        def param(shape, fan_in):
            bound = 1.0 / math.sqrt(fan_in)
            return nn.Parameter(torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound))

        self.w1 = param((num_experts, hidden, 2 * ffn), hidden)
        self.w2 = param((num_experts, ffn, hidden), ffn)

    def route(self, x: torch.Tensor) -> Routing:
        logits = self.router(x).float()
        scores = torch.softmax(logits, dim=-1)
        probs, indices = torch.topk(scores, self.topk, dim=-1)
        if self.norm_topk_prob:
            probs = probs / probs.sum(dim=-1, keepdim=True)
        counts = torch.histc(indices.flatten().float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        return Routing(probs, indices, counts.long())

    def dispatch(self, x: torch.Tensor, r: Routing) -> Dispatched:
        order = torch.argsort(r.indices.flatten(), stable=True)
        token = torch.div(order, self.topk, rounding_mode="floor")
        return Dispatched(x.index_select(0, token), r.probs.flatten().index_select(0, order), r.counts, token,
                          x.shape[0])

    def _grouped_mm(self, x, w, splits, offs):
        """Row block e of x times w[e], for w ``[E, K, N]``."""
        if self.use_grouped_mm:
            return torch._grouped_mm(x, w, offs=offs)
        return torch.cat([part @ w[e] for e, part in enumerate(x.split(splits.tolist()))])

    def experts(self, x: torch.Tensor, splits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(splits, 0, dtype=torch.int32)
        h = self._grouped_mm(x, self.w1, splits, offs)
        gate, up = h.chunk(2, dim=-1)
        a = (F.silu(gate) * up * probs[:, None]).to(x.dtype)
        return self._grouped_mm(a, self.w2, splits, offs)

    def combine(self, out: torch.Tensor, d: Dispatched) -> torch.Tensor:
        y = torch.zeros(d.num_tokens, out.shape[1], dtype=torch.float32, device=out.device)
        return y.index_add_(0, d.token, out.float()).to(out.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, H]`` -> y ``[T, H]``."""
        d = self.dispatch(x, self.route(x))
        return self.combine(self.experts(d.x, d.splits, d.probs), d)
