"""Tensors with guard regions, for the tests that kernels stay inside their tensors whatever their
index inputs hold: a tensor is a view into the middle of a larger buffer whose rest holds a sentinel.
A write out of bounds changes the sentinel; a read out of bounds brings it into the result (NaN, or
a value no in-bounds input holds)."""

from __future__ import annotations

import math

import torch

# Index values far outside any tensor of the tests: past every guard region.
FAR_INDICES = (-(2**31), -(2**20), 2**20, 2**31 - 1)


def guarded(values: torch.Tensor, guard: int, sentinel: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, buffer): `values` copied into a contiguous view of a flat buffer that holds `guard`
    elements of `sentinel` on either side of it."""
    n = values.numel()
    buffer = torch.full((n + 2 * guard,), sentinel, dtype=values.dtype, device=values.device)
    view = buffer[guard:guard + n].view(values.shape)
    view.copy_(values)
    return view, buffer


def assert_guards_hold(buffer: torch.Tensor, guard: int, sentinel: float) -> None:
    """Both guard regions of `buffer` still hold `sentinel`, bit for bit (NaN as NaN)."""
    for side in (buffer[:guard], buffer[buffer.numel() - guard:]):
        if math.isnan(sentinel):
            assert side.isnan().all(), "a guard region was written"
        else:
            assert torch.equal(side, torch.full_like(side, sentinel)), "a guard region was written"
