"""y = x · Wᵀ (+ b) for a weight in fuselab's packed int4 / int8 / fp8 layout (quant_pack), the
dequantization fused into the product; activations and output in float32, bfloat16 or float16.

Decode reads each weight once per step, so a quantized weight is read as packed words and
dequantized in registers, never written back. The paths, by rows of x (M):

- M = 1, int8 and int4 (groups of 128) weights of at least A8_MIN_WEIGHTS: quantized_gemv_a8, x's
  row rounded to int8 and multiplied by the codes with the CUDA cores' 4-byte integer dot products
  (W8A8 / W4A8), a fraction of the instructions a weight of the fp32 GEMV below.
- M <= GEMV_MAX_ROWS otherwise: `_gemv_kernel`, fp32 FMAs on CUDA cores. A program walks tiles of a
  few rows of W in runs of 16-byte word loads (its first run requested before it waits for the
  kernel before, and each next run before the current one is used), so every SM streams weights.
- M <= FUSED_MAX_ROWS: quantized_gemm's tensor-core kernel, the dequantized weight fed to tl.dot
  as the left operand (y^T = W · x^T, so a few rows of x fill the MMA's narrow side), split-K
  where the tiles of W alone would leave SMs idle.
- larger M (prefill): the weight dequantized once into the activations' dtype, then cuBLAS.
- int8 and fp8 from W8A8_MIN_ROWS rows, prefill included, and fp8 at one row for large weights
  (W8A8_ONE_ROW_MIN_WEIGHTS): W8A8 (quantized_gemm_w8a8), x quantized per row to the weight's format
  and an 8-bit × 8-bit tensor-core GEMM (int8 × int8 summed in int32, fp8 × fp8 in fp32); from 2
  to 15 rows they stay weight-only, as int4 does from 2 rows. `rounds_x` says where x is rounded.

Dequantization without int-to-float conversions (quant_codes: a code OR-ed into the mantissa of
2^23 is the float 2^23 + code, one FFMA gives q exactly). In the GEMV, int4 group scales multiply
sums over their group, not each weight.
Every launch depends on shapes alone (no host sync, output from the caching allocator), so the
decode step's CUDA graph captures it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.launch import cdiv, sm_count, use_pdl
from fuselab.kernels._common.validate import check_eps, check_float_tensor
from fuselab.kernels.quant_codes import MAGIC, _FORMAT_IDS, _codes, _high_half
from fuselab.kernels.quant_pack import (
    BLOCK_WORDS, QuantizedWeight, block_elements, check_format, packed_words, scales_shape, values_per_word)
from fuselab.kernels.quantized_gemm import launch_gemm
from fuselab.kernels.quantized_gemm_w8a8 import W8A8_FORMATS, launch_w8a8
from fuselab.kernels.quantized_gemv_a8 import launch_gemv_a8, runs_a8
from fuselab.kernels.rms_norm import rms_norm

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _gemv_kernel(
    X, Wq, S, B, R, Y, N, K, n_words, stride_sn, magic, n_tiles,
    FORMAT: tl.constexpr, PER_WORD: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, RUNS: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # A tile: BLOCK_N rows of W, a run of BLOCK_B 16-word blocks of each at a time, [BLOCK_N,
    # BLOCK_B, 16] so that a thread's 4 words (one 16-byte load) share a scale group and reuse the x
    # values it loads for every one of its rows. A program walks tiles pid, pid + programs, ... and
    # requests the next (tile, run) of W before it multiplies the current one: a few programs an SM
    # keep W streaming through their compute (a program a tile left the loads idle while it reduced
    # and the next program started).
    ELEMS: tl.constexpr = 16 * PER_WORD
    RUN: tl.constexpr = GROUP // 16
    BLOCK_W: tl.constexpr = 16 * BLOCK_B
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    steps = tl.cdiv(n_tiles - pid, programs) * RUNS
    lanes = tl.arange(0, 16)
    blocks = tl.arange(0, BLOCK_B)
    offsets = (blocks[:, None] * 16 + lanes[None, :])[None, :, :]
    x_ptrs = X + blocks[:, None] * ELEMS + lanes[None, :]
    tile_rows = tl.arange(0, BLOCK_N)
    rows = tl.minimum(pid * BLOCK_N + tile_rows, N - 1)
    w = tl.load(Wq + rows[:, None, None].to(tl.int64) * n_words + offsets)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_B, 16), dtype=tl.float32)
    for i in range(0, steps):
        nxt = tl.minimum(i + 1, steps - 1)
        next_rows = tl.minimum((pid + (nxt // RUNS) * programs) * BLOCK_N + tile_rows, N - 1)
        w_next = tl.load(Wq + next_rows[:, None, None].to(tl.int64) * n_words + offsets + (nxt % RUNS) * BLOCK_W)
        rows = (pid + (i // RUNS) * programs) * BLOCK_N + tile_rows
        row_ok = rows < N
        rows = tl.minimum(rows, N - 1)
        k0 = (i % RUNS) * BLOCK_B * ELEMS
        if FORMAT == 0:
            s_ptrs = S + rows[:, None].to(tl.int64) * stride_sn + blocks[None, :] * (ELEMS // GROUP)
        hi = _high_half(w, FORMAT)
        for j in tl.static_range(PER_WORD):
            if EVEN_K:
                x = tl.load(x_ptrs + (k0 + j * 16))
            else:
                ks = k0 + j * 16 + blocks[:, None] * ELEMS + lanes[None, :]
                x = tl.load(x_ptrs + (k0 + j * 16), mask=ks < K, other=0.0)
            prod = _codes(w, hi, magic, j, FORMAT) * x.to(tl.float32)[None, :, :]
            if FORMAT == 0:
                if j % RUN == 0:
                    part = prod
                else:
                    part += prod
                if j % RUN == RUN - 1:
                    s = tl.load(s_ptrs + (k0 + j * 16) // GROUP)
                    acc += part * s.to(tl.float32)[:, :, None]
            else:
                acc += prod
        if i % RUNS == RUNS - 1:
            y = tl.sum(tl.sum(acc, axis=2), axis=1)
            if FORMAT != 0:
                y *= tl.load(S + rows)
            if HAS_BIAS:
                y += tl.load(B + rows).to(tl.float32)
            if HAS_RESIDUAL:  # rounded first, as the add after the projection would see it
                y = y.to(Y.dtype.element_ty).to(tl.float32) + tl.load(R + rows).to(tl.float32)
            tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)
            acc = tl.zeros((BLOCK_N, BLOCK_B, 16), dtype=tl.float32)
        w = w_next
    if USE_PDL:
        # After the loop, as the bf16 GEMV: the next kernel's programs launched during the stream slowed
        # the 1B shape's step by 2% (fp8) to 8% (int4) (docs/tuning/decode-step.md, section 19).
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _dequantize_kernel(
    Wq, S, Out, N, K, n_words, stride_sn, magic,
    FORMAT: tl.constexpr, PER_WORD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    ELEMS: tl.constexpr = 16 * PER_WORD
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    w = tl.load(Wq + rows[:, None].to(tl.int64) * n_words + words[None, :],
                mask=row_ok[:, None] & (words < n_words)[None, :], other=0)
    hi = _high_half(w, FORMAT)
    if FORMAT != 0:
        s = tl.load(S + rows, mask=row_ok, other=0.0)[:, None]
    for j in tl.static_range(PER_WORD):
        ks = (words // 16) * ELEMS + j * 16 + words % 16
        if FORMAT == 0:
            s = tl.load(S + rows[:, None] * stride_sn + (ks // GROUP)[None, :],
                        mask=row_ok[:, None] & (words < n_words)[None, :], other=0.0)
        v = _codes(w, hi, magic, j, FORMAT) * s.to(tl.float32)
        tl.store(Out + rows[:, None].to(tl.int64) * K + ks[None, :], v.to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & (ks < K)[None, :])


# --------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------

# Rows of x up to which the CUDA-core GEMV runs; up to FUSED_MAX_ROWS the tensor-core kernel;
# beyond, dequantize-then-cuBLAS (whose dequantization costs a write of W per call, paid back
# once a product has that many rows to reuse it). scripts/tune-quant-gemv measures the crossovers.
GEMV_MAX_ROWS = 1
FUSED_MAX_ROWS = 256
# Rows of x from which an int8 or fp8 weight (W8A8_FORMATS) runs as W8A8 (the activations quantized too),
# at every larger M: its tile rule covers prefill, where the 8-bit MMA's rate is twice bf16's. From 16
# rows fp8's beat the W8A16 GEMM on the Llama 3 8B projections (scripts/tune-quant-gemv;
# docs/quantization.md); int8 takes the same kernel and rule. From 9, not 16: the CUDA graph that replays a
# batch of 9-15 sequences is captured at 16 rows, and the same batch without graphs must compute what it computes
# (at 9-12 rows W8A8 was also the faster, a layer of the 8B shape).
W8A8_MIN_ROWS = 9
# fp8 weights of at least this many weights run W8A8 at one row too: the 8-bit MMA takes the codes as
# loaded, where the GEMV converts each one. Faster than the GEMV on the Llama 3 8B gate/up and lm_head,
# slower on q/k/v, output and down (scripts/tune-quant-gemv --rows 1; docs/quantization.md).
W8A8_ONE_ROW_MIN_WEIGHTS = 1 << 26
# int8 and int4 (groups of 128) weights of at least this many weights take the int8-dot GEMV at one row
# (quantized_gemv_a8: x rounded to int8, dp4a): faster than the fp32 GEMV, the tensor-core kernels and
# W8A8 on every Llama 3 8B projection and the 1B gate/up, down and lm_head; slower on the 1B q/k/v and
# output (scripts/tune-quant-gemv --pdl --rows 1; docs/quantization.md).
A8_MIN_WEIGHTS = 1 << 24
# The GEMV's tile: 4 rows of W, runs of up to 16 blocks (256 words, 2 warps), 8 programs an SM:
# within a few percent of the fastest of 18 configurations at every Llama 3 8B projection and format.
GEMV_ROWS = 4
GEMV_MAX_RUN_BLOCKS = 16
GEMV_PROGRAMS_PER_SM = 8


@functools.lru_cache(maxsize=1024)
def gemv_config(n_words: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_B, num_warps, programs per SM): the longest run of blocks up to
    GEMV_MAX_RUN_BLOCKS that divides the row (so that no run is masked), a warp per 8 blocks."""
    blocks = n_words // BLOCK_WORDS
    block_b = 1
    while block_b < GEMV_MAX_RUN_BLOCKS and blocks % (2 * block_b) == 0:
        block_b *= 2
    return GEMV_ROWS, block_b, max(1, block_b // 8), GEMV_PROGRAMS_PER_SM


def _launch_gemv(x2, weight, bias, y2, config=None, residual=None) -> None:
    n, k, n_words = weight.out_features, weight.in_features, weight.data.shape[1]
    block_n, block_b, num_warps, per_sm = config or gemv_config(n_words)
    n_tiles = cdiv(n, block_n)
    pdl = use_pdl(x2.device)
    launch(_gemv_kernel, (min(n_tiles, per_sm * sm_count(x2.device)),),
        x2, weight.data, weight.scales, bias, residual, y2, n, k, n_words,
        weight.scales.stride(0), MAGIC, n_tiles,
        FORMAT=_FORMAT_IDS[weight.fmt], PER_WORD=values_per_word(weight.fmt), GROUP=weight.group_size,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, BLOCK_B=block_b,
        RUNS=n_words // (16 * block_b),
        EVEN_K=k % block_elements(weight.fmt) == 0, USE_PDL=pdl, num_warps=num_warps, num_stages=1, launch_pdl=pdl,
    )


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense [out_features, in_features] tensor of `dtype` (one kernel)."""
    n, k, n_words = weight.out_features, weight.in_features, weight.data.shape[1]
    out = torch.empty(n, k, device=weight.data.device, dtype=dtype)
    block_n, block_w = 16, 64
    launch(_dequantize_kernel, (cdiv(n, block_n), cdiv(n_words, block_w)),
        weight.data, weight.scales, out, n, k, n_words, weight.scales.stride(0), MAGIC,
        FORMAT=_FORMAT_IDS[weight.fmt], PER_WORD=values_per_word(weight.fmt), GROUP=weight.group_size,
        BLOCK_N=block_n, BLOCK_W=block_w, num_warps=4,
    )
    return out


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


def _check_weight(weight: object) -> None:
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"weight must be a QuantizedWeight (fuselab.kernels.quantize_weight), got "
                        f"{type(weight).__name__}")
    check_format(weight.fmt, weight.group_size)
    data, scales = weight.data, weight.scales
    if not isinstance(data, torch.Tensor) or data.dtype != torch.int32 or data.dim() != 2 or not data.is_contiguous():
        raise ValueError("weight.data must be a contiguous 2-D int32 tensor of packed words")
    if data.shape[1] != packed_words(weight.in_features, weight.fmt):
        raise ValueError(f"weight.data has {data.shape[1]} words a row; in_features={weight.in_features} packs "
                         f"into {packed_words(weight.in_features, weight.fmt)} ({weight.fmt})")
    expected = scales_shape(data.shape[0], weight.in_features, weight.fmt, weight.group_size)
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != expected or scales.stride(-1) != 1:
        raise ValueError(f"weight.scales must have shape {expected} with unit last stride, got "
                         f"{getattr(scales, 'shape', scales)!r}")
    allowed = (torch.bfloat16, torch.float16, torch.float32) if weight.fmt == "int4" else (torch.float32,)
    if scales.dtype not in allowed:
        raise TypeError(f"weight.scales must be one of {allowed} for {weight.fmt}, got {scales.dtype}")
    if scales.device != data.device:
        raise ValueError(f"weight.scales is on {scales.device} but weight.data is on {data.device}")
    counters = weight.counters
    if counters is not None and (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32
                                 or counters.dim() != 1 or not counters.is_contiguous()
                                 or counters.device != data.device):
        raise ValueError(f"weight.counters must be None or a contiguous 1-D int32 tensor on {data.device}, got "
                         f"{getattr(counters, 'dtype', counters)!r} on {getattr(counters, 'device', None)}")


def _check(x: object, weight: object, bias: object, out: object) -> None:
    check_float_tensor("x", x)
    _check_weight(weight)
    if x.dim() == 0 or x.shape[-1] != weight.in_features:
        raise ValueError(f"x's last dim must equal weight's in_features ({weight.in_features}), got shape "
                         f"{tuple(x.shape)}")
    if x.device != weight.data.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.data.device}")
    if bias is not None:
        check_float_tensor("bias", bias)
        if tuple(bias.shape) != (weight.out_features,) or bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(f"bias must be a ({weight.out_features},) {x.dtype} tensor on {x.device}, got "
                             f"{tuple(bias.shape)} {bias.dtype} on {bias.device}")
    if out is not None:
        shape = (*x.shape[:-1], weight.out_features)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != x.dtype \
                or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {shape} {x.dtype} tensor on {x.device}, got "
                             f"{getattr(out, 'shape', out)!r}")


def runs_w8a8(rows: int, weight: QuantizedWeight) -> bool:
    """Whether quantized_linear multiplies `rows` rows of x by `weight` as W8A8 (x rounded per row to the
    weight's 8-bit format): from W8A8_MIN_ROWS rows, and at one row for fp8 weights of W8A8_ONE_ROW_MIN_WEIGHTS."""
    if weight.fmt not in W8A8_FORMATS:
        return False
    large = weight.fmt == "fp8" and weight.out_features * weight.in_features >= W8A8_ONE_ROW_MIN_WEIGHTS
    return rows >= W8A8_MIN_ROWS or (rows == 1 and large)


def runs_gemv_a8(rows: int, weight: QuantizedWeight) -> bool:
    """Whether quantized_linear takes the int8-dot GEMV (x's one row rounded to int8): one row of an int8 or
    int4-g128 weight of at least A8_MIN_WEIGHTS weights."""
    return runs_a8(rows, weight) and weight.out_features * weight.in_features >= A8_MIN_WEIGHTS


def rounds_x(rows: int, weight: QuantizedWeight) -> str | None:
    """The format quantized_linear rounds `rows` rows of x to before multiplying them by `weight`: the
    weight's own (W8A8), "int8" (the int8-dot GEMV), or None (x as it is)."""
    if runs_gemv_a8(rows, weight):
        return "int8"
    return weight.fmt if runs_w8a8(rows, weight) else None


def _check_fold(x: torch.Tensor, weight: QuantizedWeight, residual: object, norm: object) -> None:
    if residual is not None:
        check_float_tensor("residual", residual)
        shape = (*x.shape[:-1], weight.out_features)
        if tuple(residual.shape) != shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(f"residual must be a {shape} {x.dtype} tensor on {x.device}, got "
                             f"{tuple(residual.shape)} {residual.dtype} on {residual.device}")
    if norm is not None:
        if not (isinstance(norm, tuple) and len(norm) == 2):
            raise TypeError(f"norm must be a (weight, eps) pair, got {type(norm).__name__}")
        g, eps = norm
        check_float_tensor("norm weight", g)
        if tuple(g.shape) != (weight.in_features,) or g.dtype != x.dtype or g.device != x.device:
            raise ValueError(f"norm weight must be a ({weight.in_features},) {x.dtype} tensor on {x.device}, got "
                             f"{tuple(g.shape)} {g.dtype} on {g.device}")
        check_eps(eps)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                     norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [..., K] · dequantize(weight)ᵀ (+ bias [N]) -> [..., N] in x's dtype (fp32 accumulation);
    written into `out` when given. x is rounded per row (to int8 codes, or e4m3 for fp8 weights)
    where `rounds_x` says so: one row of a large int8 or int4-g128 weight, W8A8's rows of 8-bit
    weights. Inference only: no gradient flows to the quantized weight.

    A pre-norm layer's neighbours, for a decode row: `residual` [..., N] is added to the product (rounded to x's
    dtype first, as the separate add would see it), in the one-row GEMVs' epilogue; with `norm` = (g [K], eps)
    the product is RMSNorm(x) · g's, the norm taken where x is rounded (the codes of x · g, each row's scale times
    its 1 / rms: no kernel of its own), and by the norm kernel before the product where x is not rounded."""
    _check(x, weight, bias, out)
    _check_fold(x, weight, residual, norm)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.out_features
    if out is None:
        out = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    y2 = out.view(m, n)
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    r2 = None if residual is None else residual.reshape(m, n).contiguous()
    in_epilogue = False
    if norm is not None and not (runs_gemv_a8(m, weight) or runs_w8a8(m, weight)):
        x2, norm = rms_norm(x2, norm[0].contiguous(), float(norm[1])), None
    elif norm is not None:
        norm = (norm[0].contiguous(), float(norm[1]))
    if runs_gemv_a8(m, weight):
        launch_gemv_a8(x2, weight, bias, y2, residual=r2, norm=norm)
        in_epilogue = True
    elif runs_w8a8(m, weight):
        launch_w8a8(x2, weight, bias, y2, norm=norm)
    elif m <= GEMV_MAX_ROWS:
        _launch_gemv(x2, weight, bias, y2, residual=r2)
        in_epilogue = True
    elif m <= FUSED_MAX_ROWS:
        launch_gemm(x2, weight, bias, y2)
    else:
        torch.matmul(x2, dequantize(weight, x.dtype).t(), out=y2)
        if bias is not None:
            y2 += bias
    if r2 is not None and not in_epilogue:
        y2 += r2
    return out
