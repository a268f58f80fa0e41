"""sync_module_scope without the syncs: the sum stays on the GPU and is read once, after the loop."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"verdict": "launch-bound", "not_rules": ["sync", "blocking-copy"], "syncs_per_step": 0}

args = parse(__doc__)
n = pick(1024, 64)
x = torch.randn(n, n, device=device(), dtype=torch.bfloat16)
w = torch.randn(n, n, device=device(), dtype=torch.bfloat16)
total = torch.zeros((), device=device())
for _ in steps(args):
    for _ in range(8):
        y = torch.tanh(x @ w)
        total += y.float().sum()
print(f"total {total.item():.3f}")
