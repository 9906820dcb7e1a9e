#!/usr/bin/env python3
"""Runs the anchor script (torch_anchor.py) unchanged, after bringing the GPU to its steady power
state.

Under sustained load an H200 runs at its power cap (~700 W): clocks start at boost and settle over
about a second, with a dip as the power controller catches up (scripts/gpu power-probe shows it).
torch_anchor.py starts timing at once, so its first measurements (the dense ceiling, the first
case) would see different clocks from the rest and from our benchmark, which settles the same way
(`moe-engine bench gemm --settle-ms`). Usage: anchor-steady.py ANCHOR.py [anchor arguments...]
Environment: ANCHOR_SETTLE_S (default 2).
"""
import os, runpy, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # settle.py beside this file
from settle import settle

anchor, args = sys.argv[1], sys.argv[2:]
seconds = float(os.environ.get("ANCHOR_SETTLE_S", "2"))
settle(seconds)
sys.argv = [anchor] + args
runpy.run_path(anchor, run_name="__main__")
