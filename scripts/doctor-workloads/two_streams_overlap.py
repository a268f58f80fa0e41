"""A copy on a side stream hidden behind matmuls on the default stream: the next batch is copied in while this one computes.

The batch is copied from pinned memory with non_blocking=True on a stream of its own; the default
stream waits for it (an event, not a host sync) only when it uses it, a step later. Two streams,
the copy partly under compute (on an H200: 70% of it in the script-mode run, 24% in the plain schedule
trace): compute-bound, with no copy fix to offer.
"""

import torch

from _workload import parse, require_gpu, steps

EXPECT = {"verdict": "compute-bound", "not_rules": ["pageable-copy", "blocking-copy", "sync"], "syncs_per_step": 0,
          "precision": "bf16", "streams": 2, "copy_under_compute": 0.2}

args = parse(__doc__)
require_gpu("pinned host memory and a second stream")
side = 8192
host_batches = [torch.randn(2048, side, dtype=torch.bfloat16).pin_memory() for _ in range(2)]  # 32 MiB each
w = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
copy_stream = torch.cuda.Stream()
current = host_batches[0].to("cuda")
for i in steps(args):
    with torch.cuda.stream(copy_stream):
        following = host_batches[(i + 1) % 2].to("cuda", non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    y = current
    for _ in range(3):
        y = y @ w
    torch.cuda.current_stream().wait_event(copied)  # the next step's batch, on the GPU's side only
    following.record_stream(torch.cuda.current_stream())
    current = following
