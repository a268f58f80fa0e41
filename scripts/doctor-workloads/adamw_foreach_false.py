"""A small MLP trained with AdamW(foreach=False): the optimizer loops over its parameters, eight kernels each."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"rules": ["optimizer"], "optimizer": "AdamW", "syncs_per_step": 0}

args = parse(__doc__)
width = pick(512, 32)
model = torch.nn.Sequential(*[layer for _ in range(4) for layer in (torch.nn.Linear(width, width), torch.nn.GELU())]).to(device())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
x = torch.randn(64, width, device=device())
for _ in steps(args):
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
