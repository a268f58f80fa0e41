"""y = x · Wᵀ (+ b): a Triton GEMV for one row, cuBLAS for the rest; with the residual add after it, or the
RMSNorm before it (its weight folded into W), in the GEMV's own pass at one row; and a gate/up projection
whose SwiGLU the GEMV takes too (`rms_linear_swiglu`).

At batch 1 a projection is a matrix-vector product whose cost is one read of W. cuBLAS's batch-1
kernels give each program 64 or more rows of W, so a matrix with fewer than ~64 × (SM count)
rows, such as a decode step's q/k/v, output and down projections, runs on a fraction of the SMs
and reads W well below the copy bandwidth. `_gemv_kernel` gives each program one to four rows, so even
a 2048-row matrix spreads over 1024 programs, and was faster than cuBLAS for such projections in a decode
step (docs/tuning/linear-constants.md). A plain gate/up projection, which fills the GPU anyway, stays on
cuBLAS; with its norm and SwiGLU in the same GEMV it no longer does (docs/tuning/decode-step.md, section 25).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import prepare
from fuselab.kernels._common.launch import cdiv, next_power_of_2, sm_count, use_pdl
from fuselab.kernels._common.validate import (
    FLOAT_DTYPES,
    INTERPRETED,
    check_eps,
    check_float_tensor,
    contiguous,
    needs_autograd,
    on_kernel_device,
)
from fuselab.kernels.rms_norm import rms_norm
from fuselab.kernels.swiglu import silu_and_mul

# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _gemv_kernel(
    X, W, B, R, G, Y, N, K, stride_wn, eps,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RMS_SCALE: tl.constexpr, NORM_WEIGHT: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ONE_STEP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + ks[None, :]
    # The first block of W does not depend on the kernel before: with PDL its read overlaps that
    # kernel's end (for K <= BLOCK_K, the whole of this program's share of W).
    k_ok = ks < K
    w = tl.load(w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output (x)
    if HAS_RESIDUAL:
        res = tl.load(R + rows, mask=row_ok, other=0.0)  # requested now, used after the loop
    x = tl.load(X + ks, mask=k_ok, other=0.0).to(tl.float32)
    xg = x
    if NORM_WEIGHT:  # the norm's weight, not folded into W: x · g is what W multiplies
        xg = x * tl.load(G + ks, mask=k_ok, other=0.0).to(tl.float32)
    # Products summed across K once, after the loop: the loop body is a multiply-add per element.
    acc = w.to(tl.float32) * xg[None, :]
    if RMS_SCALE:
        # x's sum of squares, in the same pass: the norm's factor without a pass of its own. A row of one
        # block is summed at once, so that no vector of squares holds registers beside the products.
        if ONE_STEP:
            ss = tl.sum(x * x, axis=0)
        else:
            sq = x * x
    if not ONE_STEP:  # rows longer than a block
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w_ptrs += BLOCK_K
            if EVEN_K:
                x = tl.load(X + k0 + ks).to(tl.float32)
                w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0)
                xg = x
                if NORM_WEIGHT:
                    xg = x * tl.load(G + k0 + ks).to(tl.float32)
            else:
                k_ok = k0 + ks < K
                x = tl.load(X + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
                w = tl.load(w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                xg = x
                if NORM_WEIGHT:
                    xg = x * tl.load(G + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * xg[None, :]
            if RMS_SCALE:
                sq += x * x
    if USE_PDL:
        # After the loop, not after the wait as the step's other kernels: this GEMV streams W at the copy
        # rate, and the next kernel launched during its run slowed the step (docs/tuning/decode-step.md).
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=1)
    if RMS_SCALE:
        if not ONE_STEP:
            ss = tl.sum(sq, axis=0)
        y *= tl.rsqrt(ss / K + eps)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # Rounded before the add, as a separate add after the projection would see it.
        y = y.to(Y.dtype.element_ty).to(tl.float32) + res.to(tl.float32)
    if SWIGLU:
        # W's rows are (gate, up) pairs: each pair's two sums, rounded as the projection's output would be,
        # make one output of silu(gate) · up.
        y = y.to(Y.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        outs = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(Y + outs, (gate * tl.sigmoid(gate) * up).to(Y.dtype.element_ty), mask=outs < N // 2)
    else:
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


# --------------------------------------------------------------------------------------------
# Host launcher
# --------------------------------------------------------------------------------------------

NUM_WARPS = 4
# cuBLAS's batch-1 tiles hold 64 rows of W: below this many rows per SM it leaves SMs idle.
ROWS_PER_SM_FOR_CUBLAS = 64


def gemv_wins(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row, and too few output features for cuBLAS to fill the GPU."""
    return x.numel() == x.shape[-1] and _few_rows_for_cublas(weight.shape[0], weight.device)


def _few_rows_for_cublas(n: int, device: torch.device) -> bool:
    if INTERPRETED or device.type != "cuda":
        return True
    return n < ROWS_PER_SM_FOR_CUBLAS * sm_count(device)


def gemv_blocks(k: int) -> tuple[int, int]:
    """(rows of W a program takes, columns a step). A program reads its first step of W before it
    waits for x (the kernel before may still be writing it), so a row of up to 4096 is read in one
    step, whole: one row of 4096 or two of <= 2048. Longer rows step 2048 columns over 4 rows.
    Chosen by a sweep over Llama 3 1B and 8B projections (docs/tuning/linear-constants.md)."""
    if k > 4096:
        return 4, 2048
    block_k = next_power_of_2(k)
    return (1 if block_k > 2048 else 2), block_k


def gemv_pair_blocks(k: int) -> tuple[int, int, int]:
    """(rows, columns a step, warps) for a weight of (gate, up) row pairs: one pair a program, a row of up to
    4096 in one step, as `gemv_blocks` reads one row of 4096 (over twice the warps for the pair)."""
    if k > 4096:
        return 2, 2048, NUM_WARPS
    block_k = next_power_of_2(k)
    return 2, block_k, (2 * NUM_WARPS if block_k > 2048 else NUM_WARPS)


def gemv_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None = None, rms_eps: float | None = None,
                swiglu: bool = False, norm_weight: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] for x with one row of K contiguous elements and weight [N, K] with unit column stride;
    `residual` [..., N] is added to the rounded y, and with `rms_eps` y is scaled by 1 / rms(x), x first
    multiplied by `norm_weight` [K] where given. With `swiglu`, W's rows are (gate, up) pairs and
    y [..., N / 2] is silu(gate) · up of each pair. Into `out` (y's shape, contiguous) when given."""
    n, k = weight.shape
    x_shape = x.shape
    y = x.new_empty(*x_shape[:-1], n // 2 if swiglu else n) if out is None else out  # x's dtype and device
    grid, launcher = _gemv_launcher(n, k, bias is not None, residual is not None, rms_eps is not None,
                                    norm_weight is not None, swiglu, use_pdl(x.device))
    # Unused slots are None (no bias, no residual, no g) or 0.0 (eps), compiled out by the flags.
    launcher(grid, x, weight, bias, residual, norm_weight, y, n, k, weight.stride()[0],
             0.0 if rms_eps is None else rms_eps)
    return y


@functools.cache
def _gemv_launcher(n: int, k: int, has_bias: bool, has_residual: bool, rms_scale: bool, norm_weight: bool,
                   swiglu: bool, pdl: bool) -> tuple[tuple[int], Callable[..., None]]:
    """(grid, the kernel with its compile-time arguments and launch options) for a weight [n, k], once per shape."""
    block_n, block_k, warps = gemv_pair_blocks(k) if swiglu else (*gemv_blocks(k), NUM_WARPS)
    return (cdiv(n, block_n),), prepare(
        _gemv_kernel, HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual, RMS_SCALE=rms_scale, NORM_WEIGHT=norm_weight,
        SWIGLU=swiglu, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, ONE_STEP=k <= block_k, USE_PDL=pdl,
        num_warps=warps, num_stages=1, launch_pdl=pdl)


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


def check_linear_inputs(x: object, weight: object, bias: object = None) -> None:
    """x [..., K], weight [N, K] and any bias [N]: float tensors of one dtype on the kernels' device (one by one,
    naming what is wrong)."""
    check_float_tensor("x", x)
    check_float_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a 0-d tensor")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dim ({x.shape[-1]}) must equal weight's in_features ({weight.shape[1]})")
    if x.dtype != weight.dtype:
        raise TypeError(f"x has dtype {x.dtype} but weight has dtype {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if bias is not None:
        check_float_tensor("bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},) to match weight's out_features, "
                             f"got {tuple(bias.shape)}")
        if bias.dtype != x.dtype or bias.device != x.device:
            raise TypeError(f"bias must be {x.dtype} on {x.device} like x, got {bias.dtype} on {bias.device}")


def _inputs_ok(x: object, weight: object, bias: object) -> bool:
    """`check_linear_inputs` would pass: x, weight and any bias of one float dtype on the kernels' device, shapes that fit."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and (bias is None or isinstance(bias, torch.Tensor))):
        return False
    x_shape, w_shape, dtype, device = x.shape, weight.shape, x.dtype, x.device
    return (dtype in FLOAT_DTYPES and weight.dtype is dtype and on_kernel_device(x) and len(w_shape) == 2
            and len(x_shape) > 0 and x_shape[-1] == w_shape[1] and weight.device == device
            and (bias is None or (bias.dtype is dtype and bias.shape == w_shape[:1] and bias.device == device)))


def _check_residual(residual: object, x: torch.Tensor, weight: torch.Tensor) -> None:
    check_float_tensor("residual", residual)
    shape = (*x.shape[:-1], weight.shape[0])
    if residual.shape != shape:
        raise ValueError(f"residual must have the output's shape {shape}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype or residual.device != x.device:
        raise TypeError(f"residual must be {x.dtype} on {x.device} like x, got {residual.dtype} on {residual.device}")


def _check_vector(name: str, v: object, x: torch.Tensor) -> None:
    check_float_tensor(name, v)
    if v.shape != x.shape[-1:]:
        raise ValueError(f"{name} must have shape ({x.shape[-1]},), one value a column of x, got {tuple(v.shape)}")
    if v.dtype != x.dtype or v.device != x.device:
        raise TypeError(f"{name} must be {x.dtype} on {x.device} like x, got {v.dtype} on {v.device}")


def _check_out(out: object, shape: tuple[int, ...], x: torch.Tensor) -> None:
    check_float_tensor("out", out)
    if out.shape != shape:
        raise ValueError(f"out must have the result's shape {shape}, got {tuple(out.shape)}")
    if out.dtype != x.dtype or out.device != x.device:
        raise TypeError(f"out must be {x.dtype} on {x.device} like x, got {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")


def _runs_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, any_rows: bool = False) -> bool:
    """One row of x that the GEMV takes; with `any_rows`, whatever W's row count (the op it fuses is worth more
    than cuBLAS's better reading of a matrix that fills the GPU)."""
    w_shape, numel = weight.shape, x.numel()
    return (numel != 0 and 0 not in w_shape and weight.stride()[1] == 1 and numel == x.shape[-1]
            and (any_rows or _few_rows_for_cublas(w_shape[0], x.device)) and not needs_autograd(x, weight, bias))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear(x, weight, bias)` for inference: x [..., K], weight [N, K], bias [N];
    with `residual` [..., N], `linear(x, weight, bias) + residual` (the pre-norm layer's residual add),
    the projection rounded to x's dtype before the add, as the separate add would see it.

    A single row (a batch-1 decode step) with N below 64 × the GPU's SM count runs the Triton GEMV, the
    add in its epilogue; everything else, any input that needs a gradient, and a weight whose rows are
    not contiguous (copying it would cost more than the GEMV saves) is F.linear (cuBLAS).
    """
    if not _inputs_ok(x, weight, bias):
        check_linear_inputs(x, weight, bias)  # one by one, naming what is wrong
    if residual is not None:
        _check_residual(residual, x, weight)
    if not _runs_gemv(x, weight, bias):
        y = F.linear(x, weight, bias)
        return y if residual is None else y + residual
    if x.stride()[-1] != 1:
        x = x.contiguous()
    return gemv_launch(x, weight, None if bias is None else contiguous(bias),
                       None if residual is None else contiguous(residual))


def rms_linear(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, bias: torch.Tensor | None = None, *,
               norm_weight: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x / rms(x) · g, weight, bias)`, rms(x) = sqrt(mean(x²) + eps) over x's last dim: an RMSNorm and
    the projection after it, in one op. g is `norm_weight` [K], or, where that is None, folded into the
    projection (weight = W · diag(g)); a weight shared with another use (an lm_head tied to the embedding
    table) keeps its g apart. With `out` (the result's shape, x's dtype, contiguous), written there.

    At one row the Triton GEMV sums x² in its own pass over x and scales the projection by 1 / rms(x),
    whatever W's row count (the norm it saves is worth more than cuBLAS's better reading of a matrix that
    fills the GPU), so the norm takes no kernel and no pass of its own; elsewhere x is normalized first,
    then F.linear.
    """
    if not _inputs_ok(x, weight, bias):
        check_linear_inputs(x, weight, bias)
    if not (type(eps) is float and eps >= 0):
        check_eps(eps)
        eps = float(eps)
    if norm_weight is not None and not (isinstance(norm_weight, torch.Tensor) and norm_weight.dtype is x.dtype
                                        and norm_weight.shape == x.shape[-1:] and norm_weight.device == x.device):
        _check_vector("norm_weight", norm_weight, x)
    if out is not None and not (isinstance(out, torch.Tensor) and out.dtype is x.dtype and out.device == x.device
                                and out.shape == (*x.shape[:-1], weight.shape[0]) and out.is_contiguous()):
        _check_out(out, (*x.shape[:-1], weight.shape[0]), x)
    if not _runs_gemv(x, weight, bias, any_rows=True):
        normed = rms_norm(x, x.new_ones(x.shape[-1]) if norm_weight is None else norm_weight, eps)
        if out is None:
            return F.linear(normed, weight, bias)
        if bias is None:
            return torch.matmul(normed, weight.t(), out=out)
        n = weight.shape[0]
        torch.addmm(bias, normed.reshape(-1, x.shape[-1]), weight.t(), out=out.view(-1, n))  # one rounding
        return out
    if x.stride()[-1] != 1:
        x = x.contiguous()
    return gemv_launch(x, weight, None if bias is None else contiguous(bias), rms_eps=eps,
                       norm_weight=None if norm_weight is None else contiguous(norm_weight), out=out)


def rms_linear_swiglu(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`silu_and_mul(rms_linear(x, weight, eps), pairs=True)`: a Llama MLP's gate/up projection of RMSNorm(x)
    and its SwiGLU, for a weight [2I, K] whose rows are (gate, up) pairs (gate row i, then up row i) with the
    norm's weight folded in; returns [..., I].

    At one row the Triton GEMV gives each program one pair of rows and writes silu(gate) · up itself: the
    norm, the projection and the SwiGLU are one kernel; elsewhere rms_linear, then the SwiGLU kernel.
    """
    if not _inputs_ok(x, weight, None):
        check_linear_inputs(x, weight)
    if weight.shape[0] % 2:
        raise ValueError(f"weight's rows are (gate, up) pairs: out_features must be even, got {weight.shape[0]}")
    if not (type(eps) is float and eps >= 0):
        check_eps(eps)
        eps = float(eps)
    if not _runs_gemv(x, weight, None, any_rows=True):
        return silu_and_mul(F.linear(rms_norm(x, x.new_ones(x.shape[-1]), eps), weight), pairs=True)
    if x.stride()[-1] != 1:
        x = x.contiguous()
    return gemv_launch(x, weight, None, rms_eps=eps, swiglu=True)
