#!/usr/bin/env python3
"""Runs one torch._grouped_mm of a benchmark case a few times (for ncu: profile its 3rd launch;
scripts/gpu profile-vs-torch does).
Usage: torch-gemm-once.py CASE FC GEMM   e.g.  qwen3-30b-a3b/balanced fc2 fwd"""
import json, os, sys
import torch

case_name, fc, gemm = sys.argv[1:4]
suite = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workloads.json")))
c = next(c for c in suite["cases"] if c["name"] == case_name)
E, H, Fd, T = c["experts"], c["hidden"], c["ffn"], c["tokens"]
counts = torch.tensor(c["tokens_per_expert"], dtype=torch.int64)
offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
N, K = (2 * Fd, H) if fc == "fc1" else (H, Fd)
bf = torch.bfloat16
x = torch.randn(T, K, device="cuda", dtype=bf)
w = torch.randn(E, N, K, device="cuda", dtype=bf) * K ** -0.5
dy = torch.randn(T, N, device="cuda", dtype=bf)
fn = {"fwd": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
      "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
      "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs)}[gemm]
for _ in range(4):
    fn()
torch.cuda.synchronize()
