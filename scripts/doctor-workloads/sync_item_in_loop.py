"""Greedy decoding that reads each chosen token back with .item(), inside a loop inside a function: sync-bound."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"verdict": "sync-bound", "rules": ["sync"], "syncs_per_step": 16}

args = parse(__doc__)
hidden = pick(4096, 256)
w = torch.randn(hidden, hidden, device=device(), dtype=torch.bfloat16)
table = torch.randn(hidden, hidden, device=device(), dtype=torch.bfloat16)


def decode() -> int:
    token = 0
    for _ in range(16):
        scores = w @ table[token]
        token = scores.argmax().item()  # doctor-label: sync
    return token


for _ in steps(args):
    decode()
