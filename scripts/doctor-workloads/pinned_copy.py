"""pageable_copy done right: the host tensor pinned once, copied with non_blocking=True."""

import torch

from _workload import parse, require_gpu, steps

EXPECT = {"verdict": "copy-bound", "not_rules": ["pageable-copy", "blocking-copy", "sync"], "syncs_per_step": 0,
          "copy": {"direction": "HtoD", "src": "Pinned", "bytes": 268435456}}

args = parse(__doc__)
require_gpu("pinned host memory")
host = torch.randn(64 * 2**20).pin_memory()
for _ in steps(args):
    x = host.to("cuda", non_blocking=True)
    y = x * 2.0
