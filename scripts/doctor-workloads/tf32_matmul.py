"""host_ahead_fp32_matmul with TF32 allowed: the matmuls run on the tensor cores at TF32; bf16 would be twice as fast."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"verdict": "compute-bound", "plain_verdict": "compute-bound", "rules": ["bf16"], "not_rules": ["tf32"],
          "precision": "tf32"}

args = parse(__doc__)
torch.set_float32_matmul_precision("high")
side = pick(8192, 128)
a = torch.randn(side, side, device=device())
b = torch.randn(side, side, device=device())
for _ in steps(args):
    for _ in range(2):
        c = a @ b
