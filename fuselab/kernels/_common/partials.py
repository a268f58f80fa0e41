"""Per-program partial sums of a per-column gradient (dweight, dbias), and their total.

A backward that walks rows in programs sums each program's share of dweight in registers and
writes it as one row of a partials buffer; the columns of that buffer are then added up. One kernel
adds them and casts to the parameter's dtype (torch's `sum(dim=0).to(dtype)` takes two), and with a
single row of partials (a decode-sized batch) there is nothing to add: the backward writes its
sums straight in the parameter's dtype and no second kernel runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.launch import cdiv

# A program adds up BLOCK_COLUMNS columns, BLOCK_PARTIALS rows of them a step, with STAGES steps' loads
# in flight: 32 x 64 fp32 is 8 KiB a step, each row's 64 columns one 256-byte segment.
_BLOCK_PARTIALS = 32
_BLOCK_COLUMNS = 64
_STAGES = 3
_NUM_WARPS = 4


@triton.jit
def _sum_partials_kernel(
    PARTIALS, OUT, n_partials, n_cols,
    BLOCK_PARTIALS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr, STAGES: tl.constexpr,
):
    # Grid: (column blocks, groups). Group g is PARTIALS[g], [n_partials, n_cols], summed into OUT[g].
    group = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    col_ok = cols < n_cols
    base = PARTIALS + group * n_partials * n_cols
    acc = tl.zeros([BLOCK_PARTIALS, BLOCK_COLUMNS], dtype=tl.float32)
    for start in tl.range(0, n_partials, BLOCK_PARTIALS, num_stages=STAGES):
        rows = start + tl.arange(0, BLOCK_PARTIALS)
        ptrs = base + rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        acc += tl.load(ptrs, mask=(rows < n_partials)[:, None] & col_ok[None, :], other=0.0)
    tl.store(OUT + group * n_cols + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_ok)


def new_partials(
    groups: int, n_partials: int, n_cols: int, dtype: torch.dtype, device: torch.device, accumulated: bool
) -> torch.Tensor:
    """A [groups, n_partials, n_cols] buffer for the backward's partial sums, fp32 or, when there is one
    row of partials, already the final `dtype`. `accumulated`: the kernel adds to the buffer across
    column blocks (looped kernels), so it starts at zero and stays fp32."""
    if accumulated:
        return torch.zeros((groups, n_partials, n_cols), dtype=torch.float32, device=device)
    final = n_partials == 1
    return torch.empty((groups, n_partials, n_cols), dtype=dtype if final else torch.float32, device=device)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[groups, n_partials, n_cols] -> [groups, n_cols] in `dtype`, summed in fp32."""
    groups, n_partials, n_cols = partials.shape
    if n_partials == 1 and partials.dtype == dtype:
        return partials[:, 0]
    out = torch.empty((groups, n_cols), dtype=dtype, device=partials.device)
    if out.numel() == 0:
        return out
    launch(_sum_partials_kernel, (cdiv(n_cols, _BLOCK_COLUMNS), groups),
        partials, out, n_partials, n_cols,
        BLOCK_PARTIALS=_BLOCK_PARTIALS, BLOCK_COLUMNS=_BLOCK_COLUMNS, STAGES=_STAGES, num_warps=_NUM_WARPS,
    )
    return out
