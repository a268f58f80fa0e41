"""naive_attention with torch.nn.functional.scaled_dot_product_attention: one fused kernel, no score matrix in memory."""

import torch
import torch.nn.functional as F

from _workload import device, parse, pick, steps

EXPECT = {"not_rules": ["attention"], "syncs_per_step": 0}

args = parse(__doc__)
batch, heads, length, head_dim = 4, 8, pick(1024, 32), 64
q, k, v = (torch.randn(batch, heads, length, head_dim, device=device(), dtype=torch.bfloat16) for _ in range(3))
with torch.no_grad():
    for _ in steps(args):
        out = q
        for _ in range(4):
            out = F.scaled_dot_product_attention(out, k, v)
