"""Elementwise kernels of about 15 us each on 16M bf16 elements: the host keeps ahead of them on its own, and on an
H200's host still does with the profiler recording stacks and shapes (it slowed the host 1.1x: 306 us to issue a
step of 327 us of GPU work), so profiled and unprofiled verdicts agree and no "the profiler changed the verdict"
note is due. Smaller kernels would tip the profiled step to launch-bound; the tests build that case synthetically."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"verdict": "memory-bound", "profiled_verdict": "memory-bound", "syncs_per_step": 0}

args = parse(__doc__)
x = torch.randn(pick(16 * 2**20, 2**10), device=device(), dtype=torch.bfloat16)
for _ in steps(args):
    y = x
    for _ in range(20):
        y = y * 1.0001
