"""A training-style loop at a script's top level that reads a scalar back with .item() eight times a step."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"verdict": "sync-bound", "rules": ["sync"], "syncs_per_step": 8}

args = parse(__doc__)
n = pick(1024, 64)
x = torch.randn(n, n, device=device(), dtype=torch.bfloat16)
w = torch.randn(n, n, device=device(), dtype=torch.bfloat16)
for _ in steps(args):
    total = 0.0
    for _ in range(8):
        y = torch.tanh(x @ w)
        total += y.float().sum().item()  # doctor-label: sync
