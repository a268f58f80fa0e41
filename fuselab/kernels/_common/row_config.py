"""Launch metadata for kernels that give one program a whole row: block size, warps, looping, grid.

Computed once per width (and per device) and cached, so a launch at decode size pays a lookup.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from fuselab.kernels._common.launch import cdiv, next_power_of_2, sm_count

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
    # As few programs as keep the GPU busy: each leaves one row of partial sums, which a second kernel
    # adds up (_common/partials.py). Two an SM (more when each has under 8 warps), one once that would give
    # each more than 32 rows: the fastest in sweeps on an H200 (docs/tuning/common-constants.md).
    per_sm = max(2, 16 // num_warps)
    while per_sm > 1 and cdiv(n_rows, per_sm * sm_count) > 32:
        per_sm //= 2
    rows_per_program = cdiv(n_rows, min(n_rows, per_sm * sm_count))
    return cdiv(n_rows, rows_per_program), rows_per_program


def row_groups(n_rows: int, num_warps: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program) for a backward that also sums a per-column gradient over rows."""
    return _row_groups(n_rows, num_warps, sm_count(device))


# Rows a backward's loop keeps in flight. Its program walks its rows one after another and a row's dx
# needs the whole row's sum, so without pipelining each row's loads wait for the last row's stores; three
# stages were needed, whatever the warps (docs/tuning/common-constants.md).
ROW_LOOP_STAGES = 3


@functools.cache
def _shared_memory_of(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def row_loop_stages(block: int, bytes_per_column: int, device: torch.device) -> int:
    """Pipeline depth for a loop over rows that loads `bytes_per_column` bytes per column of a
    `block`-wide row: ROW_LOOP_STAGES when that many rows fit in shared memory, else 1 (no staging)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    # A quarter of shared memory is left to the row reductions and to the compiler.
    fits = ROW_LOOP_STAGES * block * bytes_per_column <= _shared_memory_of(index) * 3 // 4
    return ROW_LOOP_STAGES if fits else 1
