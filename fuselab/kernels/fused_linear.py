"""y = x · Wᵀ with the op before it folded in: the projections of an LLM decode step.

At batch 1 a decode step's projection is a matrix-vector product: a read of W and nothing else,
so it runs as fast as that read. cuBLAS leaves bandwidth unused on the small matrices of a layer
(the q/k/v and output projections of a 1B or 8B model), or splits K and adds a second kernel to
sum the parts. `_gemv_kernel` gives each program a strip of BLOCK_N rows of W, streams it once,
BLOCK_K columns at a time, and sums in registers: one launch, no split-K.

Each projection's input comes from a small op that would otherwise be a launch of its own:
- `norm_weight` (and `residual`): the input is rms_norm(x + residual) · norm_weight, the Llama
  pre-norm. Every program reads the whole row once (kilobytes, from L2) for its mean square;
  program 0 also stores h = x + residual, the next layer's residual.
- `gated`: x is [gate | up] and the input is silu(gate) · up, the SwiGLU before the down projection.
Intermediate values are rounded to x's dtype where the unfused ops would store them, so the
result matches the unfused chain up to summation order.

With more than one row the product is a GEMM that cuBLAS does well: the prologue runs as its
own kernel (fuselab's rms_norm or silu_and_mul), then torch's linear.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fuselab.kernels._residual import load_input_row
from fuselab.kernels._validate import check_eps, check_float_tensor, check_like

# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_chunk(ptr, k, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptr + k).to(tl.float32)
    return tl.load(ptr + k, mask=k < K, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    X, R, H, NW, W, Y, N, K, stride_wn, eps,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROW: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_mask = cols[:, None] < N
    rstd = 1.0
    if NORM:
        # The whole row, once, for its mean square; program 0 also stores h = x + residual.
        row = tl.arange(0, BLOCK_ROW)
        row_mask = row < K
        h = load_input_row(X, R, H, row, row_mask, HAS_RESIDUAL, False)
        if HAS_RESIDUAL:
            if pid == 0:
                tl.store(H + row, h.to(H.dtype.element_ty), mask=row_mask)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
    w_ptrs = W + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        if GATED:
            g = _load_chunk(X, k, K, EVEN_K)
            u = _load_chunk(X + K, k, K, EVEN_K)
            x = (g * tl.sigmoid(g) * u).to(X.dtype.element_ty).to(tl.float32)
        else:
            x = _load_chunk(X, k, K, EVEN_K)
            if NORM:
                if HAS_RESIDUAL:
                    x = (x + _load_chunk(R, k, K, EVEN_K)).to(X.dtype.element_ty).to(tl.float32)
                x = (x * rstd * _load_chunk(NW, k, K, EVEN_K)).to(X.dtype.element_ty).to(tl.float32)
        if EVEN_K:
            w = tl.load(w_ptrs, mask=col_mask, other=0.0)
        else:
            w = tl.load(w_ptrs, mask=col_mask & (k < K)[None, :], other=0.0)
        # Summed across K once, after the loop: the loop body stays a multiply-add per element.
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
    tl.store(Y + cols, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=cols < N)


# --------------------------------------------------------------------------------------------
# Host launcher
# --------------------------------------------------------------------------------------------


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# scripts/tune-fused-linear on an H200 (bf16, L2 flushed): over the ten projections of Llama 3 1B
# and 8B (2048..14336 in, 2048..128256 out) this one config is within 7% of each shape's best,
# and 0-18% faster than cuBLAS.
GEMV_CONFIG = GemvConfig(block_n=8, block_k=1024, num_warps=8, num_stages=1)


def gemv_launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, residual: torch.Tensor | None = None,
                h_out: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                gated: bool = False, config: GemvConfig = GEMV_CONFIG) -> torch.Tensor:
    """One row: x [K] (or [2K] gated), weight [N, K] with unit column stride, out [N] contiguous."""
    n, k = weight.shape
    norm = norm_weight is not None
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, residual if residual is not None else x, h_out if h_out is not None else x,
        norm_weight if norm else x, weight, out, n, k, weight.stride(0), eps,
        NORM=norm, HAS_RESIDUAL=residual is not None, GATED=gated,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_ROW=triton.next_power_of_2(k) if norm else 1,
        EVEN_K=k % config.block_k == 0, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


def _check(x, weight, norm_weight, residual, eps, gated) -> None:
    check_float_tensor("x", x)
    check_float_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a 0-d tensor")
    if x.dtype != weight.dtype:
        raise TypeError(f"x has dtype {x.dtype} but weight has dtype {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if not isinstance(gated, bool):
        raise TypeError(f"gated must be a bool, got {type(gated).__name__}")
    expected = 2 * weight.shape[1] if gated else weight.shape[1]
    if x.shape[-1] != expected:
        what = "twice weight's in_features ([gate | up])" if gated else "weight's in_features"
        raise ValueError(f"x's last dim must be {what}, {expected}; got shape {tuple(x.shape)}")
    if gated and (norm_weight is not None or residual is not None):
        raise ValueError("gated=True takes no norm_weight or residual: the SwiGLU input has no norm before it")
    if residual is not None:
        if norm_weight is None:
            raise ValueError("residual is added before the norm: it needs norm_weight")
        check_like("residual", residual, "x", x)
    if norm_weight is not None:
        check_float_tensor("norm_weight", norm_weight)
        if norm_weight.shape != (weight.shape[1],) or norm_weight.device != x.device:
            raise ValueError(f"norm_weight must have shape ({weight.shape[1]},) on {x.device}, got "
                             f"{tuple(norm_weight.shape)} on {norm_weight.device}")
        check_eps(eps)


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """linear(p(x), weight) for x [..., K] and weight [N, K], where p is:
    - nothing, by default;
    - rms_norm(x, norm_weight, eps), with norm_weight; with residual too, rms_norm(x + residual),
      and the result is (y, x + residual);
    - silu(gate) · up with gated=True, for x = [gate | up] of width 2K.
    One row: a single GEMV launch. More rows: the prologue's kernel, then torch's linear.
    `out` (contiguous, [..., N], x's dtype) receives y in place of a new tensor: a buffer that a
    CUDA graph keeps. Inference only: no autograd."""
    _check(x, weight, norm_weight, residual, eps, gated)
    y_shape = (*x.shape[:-1], weight.shape[0])
    if out is not None:
        check_float_tensor("out", out)
        if out.shape != y_shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {y_shape} on {x.device}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
    from fuselab.kernels.rms_norm import rms_norm
    from fuselab.kernels.swiglu import silu_and_mul

    k = weight.shape[1]
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows != 1 or k == 0:
        h = None
        if gated:
            x = silu_and_mul(x)
        elif norm_weight is not None and residual is None:
            x = rms_norm(x, norm_weight, eps)
        elif norm_weight is not None:
            x, h = rms_norm(x, norm_weight, eps, residual)
        if out is None:
            y = F.linear(x, weight)
        else:
            torch.matmul(x.reshape(-1, k), weight.t(), out=out.view(-1, weight.shape[0]))
            y = out
        return y if h is None else (y, h)
    if out is None:
        out = torch.empty(y_shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else None
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    gemv_launch(x.contiguous(), w, out, residual=None if residual is None else residual.contiguous(), h_out=h,
                norm_weight=norm_weight, eps=float(eps), gated=gated)
    return out if h is None else (out, h)
