"""adamw_foreach_false with torch's fused AdamW: one multi-tensor kernel for the whole update.

Its float32 GEMMs (64 x 512 x 512) run far below the float32 rate, held up by their size, not their
math: TF32 would not shorten them, and the doctor must not offer it.
"""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"not_rules": ["optimizer", "tf32"], "syncs_per_step": 0}  # its float32 GEMMs are too small for TF32 to matter

args = parse(__doc__)
width = pick(512, 32)
model = torch.nn.Sequential(*[layer for _ in range(4) for layer in (torch.nn.Linear(width, width), torch.nn.GELU())]).to(device())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
x = torch.randn(64, width, device=device())
for _ in steps(args):
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
