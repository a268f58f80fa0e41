"""bf16 8192^3 matmuls: compute-bound at the bf16 rate, with no precision left to lower."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"verdict": "compute-bound", "plain_verdict": "compute-bound", "not_rules": ["tf32", "bf16"], "precision": "bf16"}

args = parse(__doc__)
side = pick(8192, 128)
a = torch.randn(side, side, device=device(), dtype=torch.bfloat16)
b = torch.randn(side, side, device=device(), dtype=torch.bfloat16)
for _ in steps(args):
    for _ in range(2):
        c = a @ b
