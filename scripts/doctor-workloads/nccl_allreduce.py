"""Data-parallel training's communication on one GPU: torch.distributed with NCCL at world size 1.

Each step runs matmuls and all-reduces their result, as data parallelism does with gradients, then
exchanges a buffer with all_to_all_single. At world size 1 NCCL skips the in-place all-reduce (a sum
over one rank changes nothing) but runs the all-to-all, a send and receive to itself, in its own
kernel: the doctor must count that kernel as communication, a part of the step of its own.
"""

import os
import tempfile

import torch
import torch.distributed as dist

from _workload import parse, require_gpu, steps

EXPECT = {"parts": ["communication"], "not_rules": ["sync"], "syncs_per_step": 0}

args = parse(__doc__)
require_gpu("the NCCL backend")
store = tempfile.mkdtemp()
dist.init_process_group("nccl", init_method=f"file://{os.path.join(store, 'rendezvous')}", rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
try:
    side = 4096
    a = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(side, side, device="cuda", dtype=torch.bfloat16)
    send = torch.randn(16 * 2**20, device="cuda")
    received = torch.empty_like(send)
    for _ in steps(args):
        c = a @ b
        c = c @ b
        dist.all_reduce(c)
        dist.all_to_all_single(received, send)
finally:
    dist.destroy_process_group()
