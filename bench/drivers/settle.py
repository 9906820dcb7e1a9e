"""Brings the GPU to its steady power state before timing: clocks settle over about a second of
dense work, and a measurement taken from idle reads fast. Used by anchor-steady.py (before the
shared anchor script) and fp8-anchor.py."""
import time

import torch


def settle(seconds, device="cuda"):
    """Runs 8192^3 bf16 GEMMs for `seconds` on `device`, then frees their memory."""
    if seconds <= 0:
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize(device)
    del a, b
    torch.cuda.empty_cache()
