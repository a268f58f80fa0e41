"""One-row projections with the op before them folded into the GEMV: one kernel where there were two.

In a graph-captured batch-1 decode step every kernel costs a fixed few µs whatever its work, and the
add + RMSNorm before q/k/v and the SwiGLU before the down projection read a row the GEMV after them
reads again. Here the Triton GEMV of fuselab.kernels.linear (same blocks, same dependent launch) forms
that row itself as it multiplies:

- `add_rms_norm_linear`: every program loads x (+ residual), takes the row's mean square and
  normalizes it (a row of up to 4096 is read whole in one step, so this costs a few µs of L2 reads
  next to the program's rows of W); program 0 also stores the new residual x + residual;
- `silu_mul_linear`: the down projection reads [gate | up] and computes silu(gate) · up a block at a time.

Each rounds as the unfused chain does (the sum and the normalized row, or the SwiGLU output, to the
input dtype before the product), so the results equal rms_norm / silu_and_mul followed by linear up to
the order of the mean square's sum. Anything else (several rows, a projection cuBLAS fills the GPU
with, a weight without contiguous rows, an input that needs a gradient) runs that unfused chain.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.launch import cdiv, use_pdl
from fuselab.kernels._common.residual import load_input_row
from fuselab.kernels._common.validate import (
    check_at_least_1d,
    check_eps,
    check_float_tensor,
    check_like,
    check_row_vector,
    contiguous,
    needs_autograd,
)
from fuselab.kernels.linear import NUM_WARPS, _check as check_linear, gemv_blocks, gemv_wins, linear
from fuselab.kernels.rms_norm import rms_norm
from fuselab.kernels.swiglu import silu_and_mul

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _add_rms_norm_gemv_kernel(
    X, R, NW, W, B, Y, H, N, K, eps, stride_wn,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """For K <= BLOCK_K: the whole row in one step, so no program needs a second pass over x."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    # No kernel of the step writes W or the norm's weight: with PDL their reads overlap the kernel before.
    w = tl.load(W + rows[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                other=0.0)
    norm_w = tl.load(NW + ks, mask=k_ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output (x)
    # x + residual rounded to the input dtype, as rms_norm forms it; one program stores it for the next add.
    x = load_input_row(X, R, H, ks, k_ok, HAS_RESIDUAL, False)
    if HAS_RESIDUAL:
        if pid == 0:
            tl.store(H + ks, x.to(H.dtype.element_ty), mask=k_ok)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    # Rounded as rms_norm stores its output, which the unfused GEMV then reads.
    x = (x * rstd * norm_w).to(Y.dtype.element_ty).to(tl.float32)
    acc = w.to(tl.float32) * x[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start launching
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


@triton.jit
def _silu_mul(g, u, dtype: tl.constexpr):
    """silu(gate) · up in fp32, rounded to `dtype` as silu_and_mul stores it."""
    g = g.to(tl.float32)
    return (g * tl.sigmoid(g) * u.to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _silu_mul_gemv_kernel(
    GU, W, Y, N, K, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """fuselab.kernels.linear's GEMV, its x formed from the [gate | up] row (2K wide) block by block."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + ks[None, :]
    k_ok = ks < K
    w = tl.load(w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before (gate/up) may still be running: wait for its output
    dtype = Y.dtype.element_ty
    x = _silu_mul(tl.load(GU + ks, mask=k_ok, other=0.0), tl.load(GU + K + ks, mask=k_ok, other=0.0), dtype)
    acc = w.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        if EVEN_K:
            x = _silu_mul(tl.load(GU + k0 + ks), tl.load(GU + K + k0 + ks), dtype)
            w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = k0 + ks < K
            x = _silu_mul(tl.load(GU + k0 + ks, mask=k_ok, other=0.0), tl.load(GU + K + k0 + ks, mask=k_ok, other=0.0),
                          dtype)
            w = tl.load(w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start launching
    tl.store(Y + rows, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=row_ok)


# --------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------


def _folds(x: torch.Tensor, weight: torch.Tensor, k: int, *tensors: torch.Tensor | None) -> bool:
    """Whether the one-row GEMV runs: what fuselab.kernels.linear runs as one, with no gradient needed."""
    return (x.numel() != 0 and weight.shape[0] != 0 and weight.stride(1) == 1 and x.numel() == k
            and gemv_wins(x, weight) and not needs_autograd(x, weight, *tensors))


def add_rms_norm_gemv_launch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                             weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) for one contiguous row x of K <= 4096 elements (gemv_blocks reads it in one step)."""
    n, k = weight.shape
    y = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    h = x if residual is None else torch.empty_like(x)
    block_n, block_k = gemv_blocks(k)
    pdl = use_pdl(x.device)
    # Unused pointer slots get `x`: the branch that would read them is compiled out.
    launch(_add_rms_norm_gemv_kernel, (cdiv(n, block_n),),
        x, x if residual is None else residual, norm_weight, weight, x if bias is None else bias, y, h,
        n, k, eps, weight.stride(0),
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        USE_PDL=pdl, num_warps=NUM_WARPS, num_stages=1, launch_pdl=pdl,
    )
    return y, h


def silu_mul_gemv_launch(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y [..., N] for one contiguous row gate_up = [gate | up] of 2K elements and weight [N, K] with unit
    column stride."""
    n, k = weight.shape
    y = torch.empty(*gate_up.shape[:-1], n, device=gate_up.device, dtype=gate_up.dtype)
    block_n, block_k = gemv_blocks(k)
    pdl = use_pdl(gate_up.device)
    launch(_silu_mul_gemv_kernel, (cdiv(n, block_n),),
        gate_up, weight, y, n, k, weight.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, USE_PDL=pdl,
        num_warps=NUM_WARPS, num_stages=1, launch_pdl=pdl,
    )
    return y


# --------------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------------


def add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(linear(rms_norm(h, norm_weight, eps), weight, bias), h)` with h = x + residual (x itself when
    residual is None): a pre-norm layer's "add, normalize, project", the sum kept for the next add.

    A single row whose projection fuselab.kernels.linear runs as its GEMV, with a row of up to 4096
    elements, is one kernel; anything else is fuselab's rms_norm followed by its linear.
    """
    check_linear(x, weight, bias)
    check_row_vector("norm_weight", norm_weight, "x", x)
    check_eps(eps)
    if residual is not None:
        check_like("residual", residual, "x", x)
    k = x.shape[-1]
    row_in_one_step = gemv_blocks(k)[1] >= k
    if not (row_in_one_step and _folds(x, weight, k, residual, norm_weight, bias)):
        if residual is None:
            return linear(rms_norm(x, norm_weight, eps), weight, bias), x
        y, h = rms_norm(x, norm_weight, eps, residual)
        return linear(y, weight, bias), h
    return add_rms_norm_gemv_launch(contiguous(x), None if residual is None else contiguous(residual),
                                    contiguous(norm_weight), eps, weight, None if bias is None else contiguous(bias))


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear(silu_and_mul(gate_up), weight)`: for gate_up = [gate | up] along the last dim (2K wide)
    and weight [N, K], silu(gate) · up projected by weight, as a Llama MLP's down projection.

    A single row whose projection fuselab.kernels.linear runs as its GEMV is one kernel; anything else
    is fuselab's silu_and_mul followed by its linear.
    """
    check_float_tensor("gate_up", gate_up)
    check_at_least_1d("gate_up", gate_up)
    check_float_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if gate_up.shape[-1] != 2 * weight.shape[1]:
        raise ValueError(f"gate_up's last dim ({gate_up.shape[-1]}) must hold [gate | up], twice weight's "
                         f"in_features ({weight.shape[1]})")
    if gate_up.dtype != weight.dtype:
        raise TypeError(f"gate_up has dtype {gate_up.dtype} but weight has dtype {weight.dtype}")
    if gate_up.device != weight.device:
        raise ValueError(f"gate_up is on {gate_up.device} but weight is on {weight.device}")
    if not _folds(gate_up, weight, gate_up.shape[-1]):
        return linear(silu_and_mul(gate_up), weight)
    return silu_mul_gemv_launch(contiguous(gate_up), weight)
