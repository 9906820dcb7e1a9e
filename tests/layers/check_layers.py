#!/usr/bin/env python3
"""Checks that includes only go downward through the layers of the source tree (README,
"Architecture"; docs/design.md, "Layers"). Every source file belongs to one layer; a file may
include files of its own layer or of lower layers, never of a higher one. Files that fit no layer
are errors too, so a new folder must be placed in the table before it can be used.

Usage: check_layers.py [REPO_ROOT]   (exit 0: every include goes downward; 1: a list of the others)
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

# The public vocabulary: types every layer may use. fp8 holds the FP8 operand types the backends
# take (its ops are declared beside them, over the vocabulary only).
VOCABULARY = {
    "export", "config", "error", "enum_names", "dtype", "device", "tensor", "workspace", "runtime",
    "grouped_param", "group_layout", "glu_spec", "grad_mode", "bias_epilogue", "fp8", "router_spec",
}
OP_HEADERS = {"grouped_linear", "glu", "expert_mlp", "expert_mlp_fp8", "router", "permute"}
TRAINING_HEADERS = {"modules", "moe_layer", "communicator", "offload", "checkpoint", "safetensors"}

# (layer name, rank, predicate on the path relative to the repository root). First match wins.
LAYERS = [
    ("public vocabulary", 0, lambda p: p.parent.as_posix() == "include/moe_engine" and p.stem in VOCABULARY),
    ("core", 1, lambda p: p.parts[:2] in (("src", "core"), ("src", "common"))),
    ("cuda runtime and ptx", 2, lambda p: p.parts[:3] in (("src", "cuda", "runtime"), ("src", "cuda", "ptx"))),
    ("cuda gemm problem", 3, lambda p: p.parts[:3] == ("src", "cuda", "gemm")),
    ("backends", 4, lambda p: p.parts[:2] == ("src", "cpu") or p.as_posix() == "src/cuda/backend.hpp"
        or p.parts[:3] in (("src", "cuda", "kernels"), ("src", "cuda", "sm90"), ("src", "cuda", "portable"))),
    ("cuda dispatch", 5, lambda p: p.parts[:3] == ("src", "cuda", "dispatch")),
    ("ops", 6, lambda p: p.parts[:2] == ("src", "ops")
        or (p.parent.as_posix() == "include/moe_engine" and p.stem in OP_HEADERS)),
    ("training and io", 7, lambda p: p.parts[:2] in (("src", "modules"), ("src", "io"))
        or (p.parent.as_posix() == "include/moe_engine" and p.stem in TRAINING_HEADERS)),
    ("umbrella", 8, lambda p: p.as_posix() == "include/moe_engine/moe_engine.hpp"),
    ("testing", 9, lambda p: p.parts[0] == "testing"),
    ("applications", 10, lambda p: p.parts[0] in ("tools", "python", "tests", "examples")),
]
SOURCE_SUFFIXES = {".hpp", ".cpp", ".cuh", ".cu", ".inc", ".h"}
ROOTS = ["include", "src", "testing", "tools", "python/src", "tests"]
# Include directories, in the order the build searches them, for quoted includes.
SEARCH = ["", "include", "src", "testing"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of(rel: Path):
    for name, rank, match in LAYERS:
        if match(rel):
            return name, rank
    return None


def resolve(root: Path, including: Path, target: str):
    local = (including.parent / target)
    if local.is_file():
        return local.resolve().relative_to(root)
    for base in SEARCH:
        candidate = root / base / target
        if candidate.is_file():
            return candidate.resolve().relative_to(root)
    return None  # generated (config.hpp) or third-party: not ours to place


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]).resolve()
    problems, files, edges = [], 0, 0
    for base in ROOTS:
        for path in sorted((root / base).rglob("*")):
            if path.suffix not in SOURCE_SUFFIXES or not path.is_file():
                continue
            rel = path.relative_to(root)
            here = layer_of(rel)
            if here is None:
                problems.append(f"{rel}: in no layer (add its folder to tests/layers/check_layers.py)")
                continue
            files += 1
            for target in INCLUDE.findall(path.read_text(errors="replace")):
                dep = resolve(root, path, target)
                if dep is None:
                    continue
                there = layer_of(dep)
                edges += 1
                if there is None:
                    problems.append(f"{rel}: includes {dep}, which is in no layer")
                elif there[1] > here[1]:
                    problems.append(f"{rel} ({here[0]}) includes {dep} ({there[0]}): a higher layer")
    for p in problems:
        print(p)
    print(f"{files} files, {edges} includes of the project's own files: "
          f"{'all go downward' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
