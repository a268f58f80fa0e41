"""Elementwise kernels of about 15 us each on 16M bf16 elements: the host keeps ahead of them on its own, but not
with the profiler recording stacks and shapes; profiled the step reads launch-bound, unprofiled memory-bound."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"verdict": "memory-bound", "profiled_verdict": "launch-bound", "syncs_per_step": 0}

args = parse(__doc__)
x = torch.randn(pick(16 * 2**20, 2**10), device=device(), dtype=torch.bfloat16)
for _ in steps(args):
    y = x
    for _ in range(20):
        y = y * 1.0001
