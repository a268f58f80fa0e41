"""Bias add fused with the activation that follows it: y = act(x + bias), one read and one write.

The unfused pair writes x + bias out and reads it back; here it stays in registers. Activations:
"gelu" (exact, erf), "gelu_tanh", "silu", "relu".
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.activations import ACTIVATIONS, activate, activate_grad
from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.launch import cdiv, next_power_of_2, row_and_columns, row_block_grid, sm_count
from fuselab.kernels._common.partials import new_partials, sum_partials
from fuselab.kernels._common.validate import (
    INTERPRETED,
    check_at_least_1d,
    check_float_tensor,
    check_row_vector,
    contiguous,
    needs_autograd,
    rows_and_vector_ok,
)

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _bias_act_forward_kernel(X, BIAS, Y, n_cols, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    row, cols = row_and_columns(n_cols, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) + tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, activate(z, ACTIVATION).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_act_backward_kernel(
    DY, X, BIAS, DX, DBIAS_PARTIAL, n_rows, n_cols, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
    ROWS: tl.constexpr, STAGES: tl.constexpr,
):
    # One program per (band of ROWS rows, block of columns), in memory order. It sums its dx over
    # the band in fp32, one row of DBIAS_PARTIAL per band, so dbias needs no second read of dx.
    # The loop is pipelined (STAGES rows' loads in flight) so a row's loads do not wait on the last one's math.
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(n_cols, BLOCK)
    band = pid // col_blocks
    cols = (pid % col_blocks) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    bias = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
    dbias = tl.zeros([BLOCK], dtype=tl.float32)
    first = band.to(tl.int64) * ROWS
    # The last band may hold fewer rows (a single row at decode size): no iterations past the end.
    for i in tl.range(0, tl.minimum(ROWS, n_rows - first), num_stages=STAGES):
        offs = (first + i) * n_cols + cols
        z = tl.load(X + offs, mask=col_ok, other=0.0).to(tl.float32) + bias
        dy = tl.load(DY + offs, mask=col_ok, other=0.0).to(tl.float32)
        dx = dy * activate_grad(z, ACTIVATION)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=col_ok)
        dbias += tl.where(col_ok, dx, 0.0)
    # fp32 partials, or the final dbias in its own dtype when there is one band (_common/partials.py).
    tl.store(DBIAS_PARTIAL + band.to(tl.int64) * n_cols + cols, dbias.to(DBIAS_PARTIAL.dtype.element_ty), mask=col_ok)


# --------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------

# 4096 columns per program with 4 warps, four 16-byte loads per thread for 16-bit dtypes: the exact GELU
# is bound by its arithmetic, and wide programs keep it near the copy bandwidth (docs/tuning/bias_act-constants.md).
_MAX_BLOCK = 4096
_MIN_BLOCK = 512
_NUM_WARPS = 4
# The backward: 2048 columns by bands of rows over 4 warps in a 3-stage loop, each band leaving one row of
# fp32 dbias partials (shorter bands when there are too few rows to fill the GPU), rather than summing
# dbias by reading dx again. Chosen by sweeps on an H200 (docs/tuning/bias_act-constants.md).
_BACKWARD_BLOCK = 2048
_BACKWARD_ROWS = 4 if INTERPRETED else 128
_BACKWARD_STAGES = 3


@functools.lru_cache(maxsize=1024)
def _forward_grid(n_rows: int, n_cols: int, sms: int) -> tuple[tuple[int], int]:
    """The forward's `row_block_grid` with blocks of _MAX_BLOCK, halved (down to _MIN_BLOCK) while the GPU
    would get fewer than two programs an SM: at decode size one 4096-column program would do all the
    (arithmetic-heavy) work alone."""
    block = _MAX_BLOCK
    while block > _MIN_BLOCK and n_rows * cdiv(n_cols, block) < 2 * sms:
        block //= 2
    return row_block_grid(n_rows, n_cols, block)


@functools.cache
def _band_rows(n_rows: int, col_blocks: int, sms: int) -> int:
    """Rows per band of the backward: a band's rows are walked one after another, so with few rows
    shorter bands (down to one row) give the GPU at least two programs an SM."""
    rows = _BACKWARD_ROWS
    while rows > 1 and cdiv(n_rows, rows) * col_blocks < 2 * sms:
        rows //= 2
    return rows


def bias_act_forward(x: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    y = torch.empty_like(x)
    numel = x.numel()
    if numel == 0:
        return y
    n_cols = x.shape[-1]
    grid, block = _forward_grid(numel // n_cols, n_cols, sm_count(x.device))
    launch(_bias_act_forward_kernel, grid, x, bias, y, n_cols, ACTIVATION=activation, BLOCK=block,
           num_warps=_NUM_WARPS)
    return y


def bias_act_backward(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias); dbias sums dx over rows in fp32."""
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx, torch.zeros_like(bias)
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    block = min(_BACKWARD_BLOCK, next_power_of_2(n_cols))
    col_blocks = cdiv(n_cols, block)
    rows = _band_rows(n_rows, col_blocks, sm_count(x.device))
    bands = cdiv(n_rows, rows)
    dbias_partial = new_partials(1, bands, n_cols, bias.dtype, x.device, accumulated=False)
    launch(_bias_act_backward_kernel, (bands * col_blocks,),
        dy, x, bias, dx, dbias_partial, n_rows, n_cols, ACTIVATION=activation, BLOCK=block, ROWS=rows,
        STAGES=_BACKWARD_STAGES, num_warps=_NUM_WARPS,
    )
    return dx, sum_partials(dbias_partial, bias.dtype)[0]


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


class BiasActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, activation):
        ctx.activation = activation
        ctx.save_for_backward(x, bias)
        return bias_act_forward(x, bias, activation)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx, dbias = bias_act_backward(contiguous(dy), x, bias, ctx.activation)
        return dx, dbias, None


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def bias_act(x: torch.Tensor, bias: torch.Tensor, activation: str = "gelu") -> torch.Tensor:
    """act(x + bias), with `bias` broadcast over the last dim of x; fp32 inside, returned in x's dtype.

    `activation`: "gelu" (exact), "gelu_tanh", "silu" or "relu".
    """
    if not rows_and_vector_ok(x, bias):
        check_float_tensor("x", x)  # the checks one by one, which name what is wrong
        check_at_least_1d("x", x)
        check_row_vector("bias", bias, "x", x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    x, bias = contiguous(x), contiguous(bias)
    if needs_autograd(x, bias):
        return BiasActFunction.apply(x, bias, activation)
    return bias_act_forward(x, bias, activation)
