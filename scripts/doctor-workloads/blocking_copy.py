"""Small batches copied from pinned memory without non_blocking=True: each copy waits for the GPU to drain first."""

import torch

from _workload import parse, require_gpu, steps

EXPECT = {"rules": ["blocking-copy"], "not_rules": ["pageable-copy"], "syncs_per_step": 8}

args = parse(__doc__)
require_gpu("pinned host memory")
batches = [torch.randn(512, 1024).pin_memory() for _ in range(8)]
w = torch.randn(1024, 1024, device="cuda")
for _ in steps(args):
    for batch in batches:
        x = batch.to("cuda")  # doctor-label: sync
        y = torch.relu(x @ w)
