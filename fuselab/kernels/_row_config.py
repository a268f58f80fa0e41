"""Launch metadata for kernels that give one program a whole row: block size, warps, looping, grid.

Computed once per width (and per device) and cached, so a launch at decode size pays a lookup.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from fuselab.kernels._launch import cdiv, next_power_of_2, sm_count

# Elements of one row that a program keeps in registers. Longer rows take the looped kernels, which
# stream the row in blocks of this size. Each op module reads its own copy at call time, so tests
# can lower it to reach the looped path at small widths.
MAX_FUSED_BLOCK = 65536


class RowConfig(NamedTuple):
    block: int  # power of two >= the width, or the cap when the row is streamed in blocks
    num_warps: int
    looped: bool  # the row does not fit in one block


def _warps_for(block: int) -> int:
    # Enough threads that each holds 8-16 elements: 16-byte vector loads without register spills.
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


@functools.cache
def row_config(n_cols: int, max_block: int) -> RowConfig:
    block = min(next_power_of_2(max(n_cols, 1)), max_block)
    return RowConfig(block, _warps_for(block), n_cols > block)


@functools.cache
def _row_groups(n_rows: int, num_warps: int, sm_count: int) -> tuple[int, int]:
    # A few programs per SM (fewer when each is wide) keep the GPU busy while keeping the
    # per-program partial sums, which the host adds up afterwards, small.
    target = sm_count * max(1, 32 // num_warps)
    rows_per_program = cdiv(n_rows, min(n_rows, target))
    return cdiv(n_rows, rows_per_program), rows_per_program


def row_groups(n_rows: int, num_warps: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program) for a backward that also sums a per-column gradient over rows."""
    sms = sm_count(device) if device.type == "cuda" else 4
    return _row_groups(n_rows, num_warps, sms)
