"""A small MLP trained step by step: forward, backward, then the optimizer, each a phase of the step's GPU time.

torch.optim's AdamW (foreach, its default) records its step as an `Optimizer.step#AdamW.step` range and
autograd its backward ops on a thread of its own, so the doctor's time by phase must show all three.
"""

import torch
import torch.nn.functional as F

from _workload import device, parse, pick, steps

EXPECT = {"not_rules": ["sync"], "syncs_per_step": 0, "regions": ["forward", "backward", "optimizer"]}

args = parse(__doc__)
width, batch = pick(1024, 32), pick(256, 8)
model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
                            torch.nn.GELU(), torch.nn.Linear(width, 10)).to(device())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(batch, width, device=device())
target = torch.randint(0, 10, (batch,), device=device())
for _ in steps(args):
    loss = F.cross_entropy(model(x), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
