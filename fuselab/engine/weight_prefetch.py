"""WeightPrefetch: a decode step's next weights brought into L2 while its short kernels run.

At batch 1 a decode step alternates projections, which stream their weights from HBM, with short
kernels (RoPE and attention, the norms, SwiGLU) during which HBM sits idle. At four points of each
layer a side stream asks for the bytes the next projections read first (fuselab.kernels.l2_prefetch):

- after q/k/v, while RoPE and attention run: the output projection's weight, then gate/up's first bytes;
- after the output projection, while the norm runs: gate/up's next bytes;
- after gate/up, while SwiGLU runs: down's first bytes;
- after down, while the next layer's norm runs: the next layer's q/k/v's first bytes.

The projection then reads those bytes from L2 while HBM serves the rest. The side stream joins the
step's stream at its end (`join`), so that a captured graph holds both. A prefetch is a hint: no
result changes.
"""

from __future__ import annotations

import functools

import torch

from fuselab.engine.quantize import QuantizedLinear
from fuselab.kernels.l2_prefetch import prefetch_l2

MB = 1 << 20
POINTS = 4  # after q/k/v, after the output projection, after gate/up, after down

Range = tuple[torch.Tensor, int, int]  # (storage, first byte, bytes)


def _storage(linear: torch.nn.Module) -> torch.Tensor:
    """The bytes a projection reads: the packed codes of a quantized one (its scales are a few percent)."""
    return linear.weight.data if isinstance(linear, QuantizedLinear) else linear.weight


def _take(queue: list[list], budget: int) -> list[Range]:
    """Ranges of up to `budget` bytes from the front of `queue` ([storage, next byte] items), which it advances."""
    ranges = []
    while budget > 0 and queue:
        storage, start = queue[0]
        n = min(budget, storage.numel() * storage.element_size() - start)
        ranges.append((storage, start, n))
        budget -= n
        if start + n == storage.numel() * storage.element_size():
            queue.pop(0)
        else:
            queue[0][1] = start + n
    return ranges


def plan_prefetches(layers: torch.nn.ModuleList, budgets: tuple[int, int, int, int]) -> list[list[list[Range]]]:
    """For each layer, the byte ranges asked for at each of the four points, at most budgets[point] bytes each."""
    plans = []
    for i, layer in enumerate(layers):
        attention = [[_storage(layer.self_attn.o_proj), 0], [_storage(layer.mlp.gate_up_proj), 0]]
        after_down = [] if i + 1 == len(layers) else [[_storage(layers[i + 1].self_attn.qkv_proj), 0]]
        plans.append([_take(attention, budgets[0]), _take(attention, budgets[1]),
                      _take([[_storage(layer.mlp.down_proj), 0]], budgets[2]), _take(after_down, budgets[3])])
    return plans


class WeightPrefetch:
    """Binds each decoder layer's `prefetch(point)` to this model's plan, on a side stream of `device`."""

    def __init__(self, layers: torch.nn.ModuleList, budgets: tuple[int, int, int, int], device: torch.device) -> None:
        if len(budgets) != POINTS or any(b < 0 for b in budgets):
            raise ValueError(f"budgets must be {POINTS} byte counts >= 0, got {budgets}")
        self.budgets = budgets
        self.plans = plan_prefetches(layers, budgets)
        self.stream = torch.cuda.Stream(device)
        for i, layer in enumerate(layers):
            layer.prefetch = functools.partial(self.fork, i)

    def fork(self, layer: int, point: int) -> None:
        ranges = self.plans[layer][point]
        if not ranges:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for storage, start, n in ranges:
                prefetch_l2(storage, start, n)

    def join(self) -> None:
        """The step's stream waits for every prefetch launched: a captured graph's branches meet again."""
        torch.cuda.current_stream().wait_stream(self.stream)

    @staticmethod
    def unbind(layers: torch.nn.ModuleList) -> None:
        for layer in layers:
            layer.prefetch = None
