#!/usr/bin/env python3
"""A tiny MoE block trained for a few steps with moe-engine's GroupedMLP.

Router (top-k) -> tokens sorted by expert -> GroupedMLP (FC1 -> SwiGLU x router prob -> FC2) ->
tokens summed back. The expert weights accumulate their gradients into float32 main_grad buffers
(Megatron style: the wgrad GEMM adds into main_grad directly, autograd hands back nothing), and a
plain SGD step reads main_grad. Routing stays on the device: no .item()/.tolist() on the path.

Usage: python examples/train_tiny_moe.py [--device cuda|cpu] [--steps 20]
"""
import argparse

import torch

import moe_engine.torch as me


class TinyMoE(torch.nn.Module):
    def __init__(self, hidden, ffn, experts, top_k, device, dtype):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = torch.nn.Linear(hidden, experts, device=device, dtype=torch.float32)
        self.mlp = me.GroupedMLP(experts, hidden, ffn, glu_layout="blocks:32", accumulate_into_main_grad=True,
                                 device=device, dtype=dtype)

    def forward(self, x):
        T = x.shape[0]
        probs, expert = torch.softmax(self.router(x.float()), -1).topk(self.top_k, dim=-1)
        flat_expert = expert.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)  # rows sorted by expert
        splits = torch.zeros(self.experts, dtype=torch.int64, device=x.device).index_add_(
            0, flat_expert, torch.ones_like(flat_expert))
        token = torch.arange(T, device=x.device).repeat_interleave(self.top_k)[order]
        y = self.mlp(x[token], splits, probs.reshape(-1)[order].contiguous())
        return torch.zeros_like(x).index_add_(0, token, y)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    hidden, ffn, experts = 256, 128, 8
    model = TinyMoE(hidden, ffn, experts, top_k=2, device=dev, dtype=dtype)
    for p in model.mlp.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=dev)
    # The task: fit a fixed batch to the output of a random linear map (the loss must go down).
    target = torch.nn.Linear(hidden, hidden, device=dev).requires_grad_(False)
    x = torch.randn(512, hidden, device=dev, dtype=dtype)
    lr = 0.3
    first = None
    for step in range(a.steps):
        loss = (model(x).float() - target(x.float())).square().sum(-1).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.mlp.parameters():  # expert weights: their gradient is in main_grad
                p.add_(p.main_grad.to(p.dtype), alpha=-lr)
                p.main_grad.zero_()
            for p in model.router.parameters():
                p.add_(p.grad, alpha=-lr)
                p.grad = None
        if step % 5 == 0 or step == a.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.5f}")  # .item() syncs: only when logging
            first = first or loss.item()
    me.check_errors()  # no bad routing was reported by the kernels
    if a.steps >= 20 and loss.item() > 0.5 * first:
        raise SystemExit(f"the loss did not go down: {first:.4f} -> {loss.item():.4f}")
    print("done")


if __name__ == "__main__":
    main()
