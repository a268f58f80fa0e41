"""float32 4096^3 matmuls with TF32 off (torch's default): the host runs far ahead of the GPU, which never waits for a
launch; the matmuls run on the CUDA cores at the float32 rate. The fix is TF32 or bf16, not a CUDA graph."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"verdict": "compute-bound", "plain_verdict": "compute-bound", "rules": ["tf32"],
          "not_rules": ["launch-gaps", "bf16"], "precision": "fp32", "max_launch_gap_share": 0.05}

args = parse(__doc__)
side = pick(4096, 128)
a = torch.randn(side, side, device=device())
b = torch.randn(side, side, device=device())
for _ in steps(args):
    for _ in range(3):
        c = a @ b
