"""Softmax along one dimension, numerically stable: exp(x − max) / Σ exp(x − max), in fp32.

A row that fits one block is read once. A longer row is streamed twice: the first pass keeps a
running maximum and rescales the running sum whenever the maximum grows (online softmax), the
second writes the normalized values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.row_config import MAX_FUSED_BLOCK, row_config
from fuselab.kernels._common.validate import check_at_least_1d, check_float_tensor, contiguous, needs_autograd

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _softmax_forward_kernel(X, Y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x = tl.load(X + offs, mask=mask, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(Y + offs, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_forward_looped_kernel(X, Y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    row_max = float("-inf")
    denom = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        # While every value so far is -inf the maximum is too; shifting by 0 then keeps exp() away
        # from -inf − (-inf) = NaN, and a row that is -inf throughout still ends as NaN, as in torch.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        denom = denom * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        row_max = new_max
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        tl.store(Y + base + cols, (tl.exp(x - row_max) / denom).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_backward_kernel(DY, Y, DX, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(dy * y, axis=0))
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_backward_looped_kernel(DY, Y, DX, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dy = tl.load(DY + base + cols, mask=mask, other=0.0).to(tl.float32)
        dot += dy * tl.load(Y + base + cols, mask=mask, other=0.0).to(tl.float32)
    dot_sum = tl.sum(dot, axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dy = tl.load(DY + base + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + base + cols, (y * (dy - dot_sum)).to(DX.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host launchers (over the last dim of contiguous tensors)
# --------------------------------------------------------------------------------------------


def softmax_forward(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    n_cols = x.shape[-1]
    config = row_config(n_cols, MAX_FUSED_BLOCK)
    kernel = _softmax_forward_looped_kernel if config.looped else _softmax_forward_kernel
    launch(kernel, (x.numel() // n_cols,), x, y, n_cols, BLOCK=config.block, num_warps=config.num_warps)
    return y


def softmax_backward(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dx = torch.empty_like(y)
    if y.numel() == 0:
        return dx
    n_cols = y.shape[-1]
    config = row_config(n_cols, MAX_FUSED_BLOCK)
    kernel = _softmax_backward_looped_kernel if config.looped else _softmax_backward_kernel
    launch(kernel, (y.numel() // n_cols,), dy, y, dx, n_cols, BLOCK=config.block, num_warps=config.num_warps)
    return dx


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = softmax_forward(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_backward(contiguous(dy), y)


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of `x` along `dim`, computed in fp32 and returned in x's dtype."""
    check_float_tensor("x", x)
    check_at_least_1d("x", x)
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {dim!r}")
    last = dim in (-1, x.dim() - 1)
    # The kernels work on rows; another dim is moved last (a copy) and the result moved back (a view).
    rows = contiguous(x if last else x.movedim(dim, -1))
    y = SoftmaxFunction.apply(rows) if needs_autograd(rows) else softmax_forward(rows)
    return y if last else y.movedim(-1, dim)
