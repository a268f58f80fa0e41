"""RMSNorm over the last dimension, optionally fused with the residual add that precedes it.

y = x / sqrt(mean(x²) + eps) · weight. With `residual`, h = x + residual is formed, stored and
normalized in the same pass, and `(y, h)` is returned: one read of x and residual, one write of y
and h, where the unfused pair reads h back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import launch, prepare
from fuselab.kernels._common.launch import use_pdl
from fuselab.kernels._common.partials import new_partials, sum_partials
from fuselab.kernels._common.residual import load_input_row
from fuselab.kernels._common.row_config import MAX_FUSED_BLOCK, row_config, row_groups, row_loop_stages
from fuselab.kernels._common.validate import (
    check_at_least_1d,
    check_eps,
    check_float_tensor,
    check_like,
    check_row_vector,
    contiguous,
    like_ok,
    needs_autograd,
    rows_and_vector_ok,
)

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_forward_kernel(
    X, R, W, Y, H, RSTD, n_cols, eps, HAS_RESIDUAL: tl.constexpr, STORE_RSTD: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)  # no kernel before writes it: read before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    x = load_input_row(X, R, H, offs, mask, HAS_RESIDUAL, True)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if STORE_RSTD:
        tl.store(RSTD + row, rstd)
    tl.store(Y + offs, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_forward_looped_kernel(
    X, R, W, Y, H, RSTD, n_cols, eps, HAS_RESIDUAL: tl.constexpr, STORE_RSTD: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """For rows longer than one block: a pass for the mean square, a second to normalize."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    row = tl.program_id(0).to(tl.int64)
    base = row * n_cols
    sum_sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = load_input_row(X, R, H, base + cols, mask, HAS_RESIDUAL, True)
        sum_sq += x * x
    rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / n_cols + eps)
    if STORE_RSTD:
        tl.store(RSTD + row, rstd)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        # Recomputed from the inputs rather than read back from H, so no pass depends on another's stores.
        x = load_input_row(X, R, H, base + cols, mask, HAS_RESIDUAL, False)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + base + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    DY, X, W, RSTD, DH, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program, HAS_DH: tl.constexpr, BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Each program takes a run of rows, writes their dx, and sums dy·x̂ for dweight in registers;
    the next rows' loads are issued while this one is reduced (STAGES, see row_loop_stages)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first_row = pid.to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program, num_stages=STAGES):
        row = first_row + i
        # Rows past the end (in the last program) get an empty mask; one comparison per element.
        mask = cols < tl.where(row < n_rows, n_cols, 0)
        offs = row * n_cols + cols
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=row < n_rows, other=0.0)
        x_hat = x * rstd
        dy_w = dy * w
        dx = (dy_w - x_hat * (tl.sum(dy_w * x_hat, axis=0) / n_cols)) * rstd
        if HAS_DH:
            dx += tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    # fp32 partials, or the final dweight in W's dtype when this is the only program (_common/partials.py).
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw.to(DW_PARTIAL.dtype.element_ty), mask=col_mask)


@triton.jit
def _rms_norm_backward_looped_kernel(
    DY, X, W, RSTD, DH, DX, DW_PARTIAL, n_rows, n_cols, rows_per_program, HAS_DH: tl.constexpr, BLOCK: tl.constexpr
):
    """As above for rows longer than one block; the dweight sums live in this program's row of DW_PARTIAL."""
    pid = tl.program_id(0)
    dw_base = pid.to(tl.int64) * n_cols
    first_row = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = first_row + i
        row_ok = row < n_rows
        row_cols = tl.where(row_ok, n_cols, 0)
        base = row * n_cols
        rstd = tl.load(RSTD + row, mask=row_ok, other=0.0)
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < row_cols
            dy = tl.load(DY + base + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            dot += dy * w * x * rstd
        mean_dot = tl.sum(dot, axis=0) / n_cols
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < row_cols
            dy = tl.load(DY + base + cols, mask=mask, other=0.0).to(tl.float32)
            x_hat = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32) * rstd
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            dx = (dy * w - x_hat * mean_dot) * rstd
            if HAS_DH:
                dx += tl.load(DH + base + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + base + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw = tl.load(DW_PARTIAL + dw_base + cols, mask=mask, other=0.0)
            tl.store(DW_PARTIAL + dw_base + cols, dw + dy * x_hat, mask=mask)


# --------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, save_rstd: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(y, h or None, rstd per row in fp32 or None) for contiguous inputs; rstd is kept for the
    backward only, so inference skips its allocation and store."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device) if save_rstd else None
    if n_rows == 0:  # no elements
        return y, h, rstd
    launcher = _forward_launcher(n_cols, MAX_FUSED_BLOCK, residual is not None, save_rstd, use_pdl(x.device))
    # Unused pointer slots are None, which the launcher passes cheaper than a tensor: the branch that
    # would read them is compiled out, and the flags that say so are in the launcher's key.
    launcher((n_rows,), x, residual, weight, y, h, rstd, n_cols, eps)
    return y, h, rstd


@functools.cache
def _forward_launcher(n_cols: int, max_block: int, has_residual: bool, save_rstd: bool,
                      pdl: bool) -> Callable[..., None]:
    """The forward kernel for rows of n_cols with its compile-time arguments and launch options, once per
    width and flags."""
    config = row_config(n_cols, max_block)
    kernel = _rms_norm_forward_looped_kernel if config.looped else _rms_norm_forward_kernel
    return prepare(kernel, HAS_RESIDUAL=has_residual, STORE_RSTD=save_rstd, BLOCK=config.block, USE_PDL=pdl,
                   num_warps=config.num_warps, launch_pdl=pdl)


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dh: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight); `x` is the normalized input (h when a residual was added), `dh` the gradient of h."""
    n_cols = x.shape[-1]
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx, torch.zeros_like(weight)
    n_rows = x.numel() // n_cols
    config = row_config(n_cols, MAX_FUSED_BLOCK)
    n_programs, rows_per_program = row_groups(n_rows, config.num_warps, x.device)
    dw_partial = new_partials(1, n_programs, n_cols, weight.dtype, x.device, accumulated=config.looped)
    if config.looped:
        kernel, staging = _rms_norm_backward_looped_kernel, {}
    else:
        loaded = dy.element_size() + x.element_size() + (0 if dh is None else dh.element_size())
        kernel, staging = _rms_norm_backward_kernel, {"STAGES": row_loop_stages(config.block, loaded, x.device)}
    launch(kernel, (n_programs,),
        dy, x, weight, rstd, dy if dh is None else dh, dx, dw_partial, n_rows, n_cols, rows_per_program,
        HAS_DH=dh is not None, BLOCK=config.block, num_warps=config.num_warps, **staging,
    )
    return dx, sum_partials(dw_partial, weight.dtype)[0]


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        y, h, rstd = rms_norm_forward(x, weight, eps, residual, save_rstd=True)
        ctx.has_residual = residual is not None
        ctx.save_for_backward(x if h is None else h, weight, rstd)
        # An unused h gets no gradient tensor, rather than a zero-filled one the kernel would add.
        ctx.set_materialize_grads(False)
        return y if h is None else (y, h)

    @staticmethod
    def backward(ctx, dy, dh=None):
        x, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dx, dw = rms_norm_backward(contiguous(dy), x, weight, rstd, None if dh is None else contiguous(dh))
        return dx, dw, dx if ctx.has_residual else None, None


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x` over its last dim, scaled by `weight`; computed in fp32, returned in x's dtype.

    With `residual` (same shape and dtype as x), returns `(rms_norm(x + residual) * weight, x + residual)`
    from one kernel: the pre-norm transformer's "add, then normalize" with the sum kept for the next add.
    """
    # The common case in one pass; anything else takes the checks one by one, which name what is wrong.
    if not (type(eps) is float and eps >= 0 and rows_and_vector_ok(x, weight)
            and (residual is None or like_ok(residual, x))):
        check_float_tensor("x", x)
        check_at_least_1d("x", x)
        check_row_vector("weight", weight, "x", x)
        check_eps(eps)
        if residual is not None:
            check_like("residual", residual, "x", x)
    x = contiguous(x)
    weight = contiguous(weight)
    if residual is not None:
        residual = contiguous(residual)
    if needs_autograd(x, weight, residual):
        return RMSNormFunction.apply(x, weight, residual, eps)
    y, h, _ = rms_norm_forward(x, weight, eps, residual, save_rstd=False)
    return y if h is None else (y, h)
