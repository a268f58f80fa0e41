"""A small GPT trained the plain-PyTorch way: AdamW(foreach=False) and loss.item() every step.

Launch-bound: hundreds of small kernels a step, the optimizer's per-parameter loop among them. The
optimizer's chain is reported once, with the fused optimizer as its fix; the one sync, at the end of
the step, costs little (the GPU has little left to do), but its line must be the .item() statement.
"""

import torch
import torch.nn.functional as F

from _workload import device, parse, pick, steps

EXPECT = {"verdict": "launch-bound", "plain_verdict": "launch-bound", "rules": ["optimizer"],
          "optimizer": "AdamW", "syncs_per_step": 1}

args = parse(__doc__)
vocab, width, heads, length, batch = pick(4096, 64), pick(256, 32), 4, pick(128, 16), 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, heads, c // heads).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(attn)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.zeros(length, width))
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


model = GPT().to(device())
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)
tokens = torch.randint(0, vocab, (batch, length + 1), device=device())
losses = []
for _ in steps(args):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())  # doctor-label: sync
