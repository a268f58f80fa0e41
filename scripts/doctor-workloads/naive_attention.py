"""Attention written as matmul -> scale -> softmax -> matmul: the score matrix goes to memory and back."""

import math

import torch

from _workload import device, parse, pick, steps

EXPECT = {"rules": ["attention"], "syncs_per_step": 0}

args = parse(__doc__)
batch, heads, length, head_dim = 4, 8, pick(1024, 32), 64
q, k, v = (torch.randn(batch, heads, length, head_dim, device=device(), dtype=torch.bfloat16) for _ in range(3))
with torch.no_grad():
    for _ in steps(args):
        out = q
        for _ in range(4):
            scores = out @ k.transpose(-2, -1) / math.sqrt(head_dim)
            out = torch.softmax(scores, dim=-1) @ v
