"""Rows of x rounded for a quantized projection by the kernel that makes them: RMSNorm, and SwiGLU on a
merged gate/up, write the codes that quantized_linear would round x to (`rounds_x`) in place of x.

Why: where quantized_linear rounds x (its int8-dot GEMV at one row, W8A8), it first launches
`quantize_rows`, a kernel a row that reads x back and writes the codes. At batch-1 decode that is one
kernel more on the critical path per projection, each paying a launch's fixed cost for a few
microseconds of work. The kernel that produces x holds the row already: it rounds it as it goes.

- `RoundedRows`: the codes [M, Kp] in the order of a weight of `fmt` (quantize_rows' orders: "int4",
  "int8", "fp8"), their scales [M] fp32, and x's dtype and width, which quantized_linear takes in place
  of x for a weight of that format.
- The rounding is quantize_rows', applied to the values the unfused kernel would store: each normalized
  or gated element is rounded to x's dtype first, so the codes are those of the unfused pair up to the
  order of the norm's sum of squares.
- One program a row, which holds the row in registers: rows up to MAX_QUANT_BLOCK wide. Wider rows
  take the unfused pair (the same result, one kernel more).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.launch import next_power_of_2, use_pdl
from fuselab.kernels._common.residual import load_input_row
from fuselab.kernels._common.validate import INTERPRETED, check_eps, check_float_tensor
from fuselab.kernels.quant_codes import _FORMAT_IDS
from fuselab.kernels.quant_pack import QUANT_FORMATS, packed_words, values_per_word
from fuselab.kernels.quantized_gemm_w8a8 import (
    MAX_QUANT_BLOCK, RoundedRows, _row_codes, _row_scale, code_sources, quantize_rows)
from fuselab.kernels.rms_norm import rms_norm
from fuselab.kernels.swiglu import silu_and_mul


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _round_row(y, XQ, XS, row, cols, KP, FORMAT: tl.constexpr, EXACT: tl.constexpr):
    """Store a row's values (in code order, zeros past K) as quantize_rows' codes and scale."""
    scale = _row_scale(tl.max(tl.abs(y), axis=0), FORMAT)
    tl.store(XQ + row * KP + cols, _row_codes(y, scale, FORMAT, EXACT), mask=cols < KP)
    tl.store(XS + row, scale)


@triton.jit
def _rms_norm_rounded_kernel(
    X, R, W, H, XQ, XS, K, KP, eps, HAS_RESIDUAL: tl.constexpr, FORMAT: tl.constexpr, INT4_ORDER: tl.constexpr,
    EXACT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # The row is loaded in code order (a permutation within each block of 64 or 128 elements, past K masked),
    # so the codes are stored as computed; h is stored back in x's order.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    src = code_sources(cols, INT4_ORDER)
    mask = src < K
    w = tl.load(W + src, mask=mask, other=0.0).to(tl.float32)  # no kernel before writes it: read before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    x = load_input_row(X, R, H, row * K + src, mask, HAS_RESIDUAL, True)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    y = (x * rstd * w).to(X.dtype.element_ty).to(tl.float32)  # as rms_norm would store it
    _round_row(y, XQ, XS, row, cols, KP, FORMAT, EXACT)


@triton.jit
def _silu_and_mul_rounded_kernel(
    X, XQ, XS, K, KP, stride_xm, FORMAT: tl.constexpr, INT4_ORDER: tl.constexpr, EXACT: tl.constexpr,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    src = code_sources(cols, INT4_ORDER)
    mask = src < K
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # gate/up is the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    g = tl.load(X + row * stride_xm + src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_xm + K + src, mask=mask, other=0.0).to(tl.float32)
    y = (g * tl.sigmoid(g) * u).to(X.dtype.element_ty).to(tl.float32)  # as silu_and_mul would store it
    _round_row(y, XQ, XS, row, cols, KP, FORMAT, EXACT)


# --------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------


def _check_fmt(fmt: object) -> None:
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"fmt must be one of {QUANT_FORMATS}, got {fmt!r}")


def _codes_buffers(m: int, k: int, fmt: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    kp = values_per_word(fmt) * packed_words(k, fmt)
    codes = torch.empty(m, kp, device=device, dtype=torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
    return codes, torch.empty(m, device=device, dtype=torch.float32), kp


def _launch_options(kp: int, fmt: str, device: torch.device) -> dict:
    block = next_power_of_2(kp)
    pdl = use_pdl(device)
    return dict(FORMAT=_FORMAT_IDS["fp8" if fmt == "fp8" else "int8"], INT4_ORDER=fmt == "int4", EXACT=INTERPRETED,
                BLOCK=block, USE_PDL=pdl, num_warps=max(1, min(16, block // 1024)), num_stages=1, launch_pdl=pdl)


def _rounded(x2: torch.Tensor, fmt: str) -> RoundedRows:
    codes, scales = quantize_rows(x2, values_per_word(fmt) * packed_words(x2.shape[1], fmt), fmt)
    return RoundedRows(codes, scales, fmt, x2.dtype, x2.shape[1])


def rms_norm_rounded(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                     fmt: str) -> tuple[RoundedRows, torch.Tensor]:
    """(rms_norm(x + residual) rounded for a weight of `fmt`, x + residual), or x itself as the second
    without a residual: rms_norm's result as the codes quantized_linear would round it to."""
    check_float_tensor("x", x)
    check_float_tensor("weight", weight)
    check_eps(eps)
    _check_fmt(fmt)
    k = x.shape[-1] if x.dim() else 0
    if x.dim() == 0 or tuple(weight.shape) != (k,) or weight.device != x.device:
        raise ValueError(f"weight must be a ({k},) tensor on x's device, got {tuple(weight.shape)} on {weight.device}")
    if residual is not None:
        check_float_tensor("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual must match x ({tuple(x.shape)} {x.dtype}), got {tuple(residual.shape)} "
                             f"{residual.dtype}")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if m == 0:
        return RoundedRows(*_codes_buffers(0, k, fmt, x.device)[:2], fmt, x.dtype, k), x
    if k > MAX_QUANT_BLOCK:
        if residual is None:
            return _rounded(rms_norm(x2, weight, eps), fmt), x
        y, h = rms_norm(x2, weight, eps, residual.reshape(-1, k))
        return _rounded(y, fmt), h.view(x.shape)
    codes, scales, kp = _codes_buffers(m, k, fmt, x.device)
    h = torch.empty_like(x2) if residual is not None else None
    r2 = residual.reshape(-1, k).contiguous() if residual is not None else None
    launch(_rms_norm_rounded_kernel, (m,), x2, r2, weight.contiguous(), h, codes, scales, k, kp, eps,
           HAS_RESIDUAL=residual is not None, **_launch_options(kp, fmt, x.device))
    return RoundedRows(codes, scales, fmt, x.dtype, k), (x if h is None else h.view(x.shape))


def silu_and_mul_rounded(x: torch.Tensor, fmt: str) -> RoundedRows:
    """silu_and_mul(x) (x = [gate | up] in its last dim) rounded for a weight of `fmt`: the codes
    quantized_linear would round silu_and_mul's result to."""
    check_float_tensor("x", x)
    _check_fmt(fmt)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be even ([gate | up]), got shape {tuple(x.shape)}")
    k = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return RoundedRows(*_codes_buffers(0, k, fmt, x.device)[:2], fmt, x.dtype, k)
    if k > MAX_QUANT_BLOCK:
        return _rounded(silu_and_mul(x2), fmt)
    codes, scales, kp = _codes_buffers(m, k, fmt, x.device)
    launch(_silu_and_mul_rounded_kernel, (m,), x2, codes, scales, k, kp, x2.stride(0),
           **_launch_options(kp, fmt, x.device))
    return RoundedRows(codes, scales, fmt, x.dtype, k)
