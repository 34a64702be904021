#!/usr/bin/env python3
"""Compares two PTX dumps kernel by kernel: whether each kernel's floating-point and MMA
instructions come in the same order (the integer and address instructions around them may move).
A refactor that keeps a kernel's bits keeps this sequence; ptxas does not reassociate IEEE
operations, so the same sequence means the same results.

Make the dumps with the NVRTC test, once per tree:
  DRAMATIS_DUMP_PTX=DIR LD_LIBRARY_PATH=$PWD/target/nvrtc/nvidia/cu13/lib \
    cargo test -q --release -p backend-cuda every_kernel_compiles
Usage: scripts/ptx-same-floats.py OLD_DIR NEW_DIR [FILE_SUBSTRING]
Exit status 1 when a kernel in both dumps differs in its float sequence."""
import os
import re
import sys

FLOAT = re.compile(r"\.f32|\.f64|\.f16|\.bf16|mma|\.tf32|cvt\.rn|\.rn\.|ex2|rsqrt|rcp|sqrt")


def kernels(path):
    text = open(path).read()
    return {m.group(1): m.group(0).splitlines()
            for m in re.finditer(r"\.entry (\w+)\((.*?)^\}", text, re.S | re.M)}


def floats(lines):
    out = []
    for line in lines:
        s = line.strip()
        if not s or s.startswith(("//", "$", ".", "{", "}")):
            continue
        op = s.split()[0]
        if FLOAT.search(op):
            out.append(op)
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    old, new = sys.argv[1], sys.argv[2]
    pick = sys.argv[3] if len(sys.argv) > 3 else ""
    bad = 0
    for name in sorted(os.listdir(old)):
        if not name.endswith(".ptx") or pick not in name or not os.path.exists(os.path.join(new, name)):
            continue
        a, b = kernels(os.path.join(old, name)), kernels(os.path.join(new, name))
        both = [k for k in a if k in b]
        differ = [k for k in both if floats(a[k]) != floats(b[k])]
        same_text = sum(1 for k in both if a[k] == b[k])
        added = sorted(set(b) - set(a))
        print(f"{name}: {len(both)} kernels in both, {same_text} identical text, "
              f"float sequence differs: {differ or 'none'}; new: {added or 'none'}")
        bad += len(differ)
    sys.exit(1 if bad else 0)


main()
