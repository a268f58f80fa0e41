"""A sampler method whose torch.unique (Python code in torch, then a sync inside it) reads a size back: the sync
is placed at the method's line that called into torch, not inside torch."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"rules": ["sync"]}

args = parse(__doc__)
vocab, hidden = pick(32000, 512), pick(2048, 64)


class Sampler:
    def __init__(self) -> None:
        self.head = torch.randn(hidden, vocab, device=device(), dtype=torch.bfloat16)

    def distinct_tokens(self, h: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax((h @ self.head).float(), dim=-1)
        picked = torch.multinomial(probs, 4)
        return torch.unique(picked)  # doctor-label: sync


sampler = Sampler()
h = torch.randn(8, hidden, device=device(), dtype=torch.bfloat16)
for _ in steps(args):
    for _ in range(8):
        sampler.distinct_tokens(h)
