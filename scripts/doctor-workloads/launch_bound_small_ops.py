"""Hundreds of tiny elementwise kernels at batch 1: each takes less time than launching it."""

import torch

from _workload import device, parse, steps

EXPECT = {"verdict": "launch-bound", "plain_verdict": "launch-bound", "rules": ["launch-gaps"], "kernels_per_step": 300,
          "syncs_per_step": 0}

args = parse(__doc__)
x = torch.randn(1, 256, device=device())
for _ in steps(args):
    y = x
    for _ in range(100):
        y = torch.tanh(y * 1.0001 + 0.001)
