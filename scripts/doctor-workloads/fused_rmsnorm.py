"""unfused_rmsnorm with fuselab.kernels.rms_norm: one kernel per norm, no chain to fuse."""

import torch

from _workload import device, parse, pick, steps
from fuselab.kernels import rms_norm

EXPECT = {"not_rules": ["kernel:rms_norm"], "syncs_per_step": 0}

args = parse(__doc__)
width = pick(1024, 32)
weights = [torch.ones(width, device=device()) for _ in range(8)]
projections = [torch.randn(width, width, device=device()) / width**0.5 for _ in range(8)]
h = torch.randn(4, width, device=device())
with torch.no_grad():
    for _ in steps(args):
        x = h
        for weight, proj in zip(weights, projections):
            x = rms_norm(x, weight) @ proj
