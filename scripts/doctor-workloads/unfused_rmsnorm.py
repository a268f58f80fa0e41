"""RMSNorm written out by hand (pow -> mean -> add -> rsqrt -> mul -> mul) between small projections: six kernels
where fuselab.kernels.rms_norm is one."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"rules": ["kernel:rms_norm"], "syncs_per_step": 0}

args = parse(__doc__)
width = pick(1024, 32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


weights = [torch.ones(width, device=device()) for _ in range(8)]
projections = [torch.randn(width, width, device=device()) / width**0.5 for _ in range(8)]
h = torch.randn(4, width, device=device())
for _ in steps(args):
    x = h
    for weight, proj in zip(weights, projections):
        x = rms_norm(x, weight) @ proj
