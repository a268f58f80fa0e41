"""y = x · Wᵀ (+ b) for an int8 or fp8 weight (quant_pack) as W8A8: x quantized per row to the weight's
format, then one 8-bit × 8-bit tensor-core GEMM (quantized_linear's 8-bit path from W8A8_MIN_ROWS rows).

Why: the W8A16 kernel (quantized_gemm) converts each code to bf16 in registers and sends it through
shared memory to the MMA, one code position per tl.dot. Here both operands are 8-bit in memory and
go to the MMA as they are loaded, K = BLOCK_K a tl.dot, at the tensor cores' 8-bit rate (int8 and
fp8 MMAs both run at twice bf16's).

- The packed weight, viewed as bytes, is a plain [N, Kp] 8-bit matrix (Kp = 4 · words a row) whose
  column b = 64·blk + 4·i + j holds element 64·blk + 16·j + i of the row (code j of word i), for
  both formats. `_quantize_rows_kernel` writes x's codes in that order, so the product is an
  ordinary GEMM over the Kp columns; padding columns are zeros on both sides (int8's pad code 128
  is q = 0).
- x: per row s_m = max(amax(|x_m|) / c, FP32_TINY) (no division by zero on an all-zero row, whose
  codes are then zeros), c = 448 for fp8 (codes = e4m3(x / s_m), round to nearest even) and 127
  for int8 (codes = x / s_m rounded to the nearest integer, ties to even, within [-127, 127]). The
  weight keeps its per-channel fp32 scales: y[m, n] = acc[n, m] · w_scale[n] · s_m (+ bias[n]), in
  x's dtype. Activation rounding adds at most 2^-4 · |x_k| (2^-10 · s_m below e4m3's normal range)
  per element for fp8, s_m / 2 = amax / 254 for int8.
- fp8: the weight's bytes are e4m3 codes, multiplied as loaded. The MMA's own fp8 accumulator keeps
  fewer bits than fp32; each step's sums are added to an fp32 accumulator (max_num_imprecise_acc =
  BLOCK_K), as torch._scaled_mm does without use_fast_accum.
- int8: a stored byte is q + 128; one XOR by 0x80 a byte makes it q as a two's complement int8
  ((q + 128) ^ 0x80 == q), the only op between the load and int8 × int8 tl.dot, which accumulates in
  int32: exact (|sum| <= 127² · K stays below 2^31 up to K = 133143). The int32 sums become fp32
  once, after the loop, before the scales and the split-K partials.
- Swap-AB as quantized_gemm: a program owns BLOCK_N rows of W (the MMA's wide side) by BLOCK_M rows
  of x. Both tiles are K-major (W [BLOCK_N, BLOCK_K], x^T [BLOCK_K, BLOCK_M] with K contiguous), the
  layout Hopper's 8-bit wgmma takes. Rows past M and N are clamped, not masked, and BLOCK_K divides
  Kp: no load in the loop is masked, so the pipeliner streams every stage.
- split-K as quantized_gemm: the splits store fp32 partials, the one drawing the last ticket of the
  tile's counter adds them in split order (deterministic) and writes y; SPLIT_K = 1 writes y directly.

`w8a8_config` picks the tiles and the split by the bytes the busiest SM reads (quantized_gemm's rule,
with one byte an element of x and W), the same for both formats. Triton's interpreter rounds fp32 to
e4m3 wrongly where the mantissa carries into the exponent, so interpreted fp8 launches round in
integer arithmetic, exactly, and multiply the fp8 tiles as fp32 (exact products, as quantized_gemm
does for bf16); its int8 tl.dot sums in int32, exactly, as the GPU does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.launch import cdiv, next_power_of_2, sm_count, use_pdl
from fuselab.kernels._common.split_k import reduce_splits, tile_counters
from fuselab.kernels._common.tiles import clamped_rows
from fuselab.kernels._common.validate import INTERPRETED
from fuselab.kernels.quant_codes import _FORMAT_IDS
from fuselab.kernels.quant_pack import FP8_MAX, QuantizedWeight

W8A8_FORMATS = ("int8", "fp8")
FP32_TINY = torch.finfo(torch.float32).tiny  # the scale floor: a normal fp32, so x / s never divides by 0
INT8_MAX = 127.0  # the largest int8 code of x, as of a weight (symmetric: x's codes never take -128)
MAX_BLOCK_M = 128
BLOCK_NS = (64, 128, 256)
# Accumulators a tile: 64 registers a thread at 8 warps, and as many for the per-step partial sums.
MAX_ACCUMULATORS = 16384
MAX_SPLIT_K = 8
# 128 bytes a row of a tile (one swizzled shared-memory line, two 8-bit MMA K-steps); 64 where Kp is odd in 64s.
BLOCK_KS = (128, 64)
MAX_STAGES = 4
SHARED_BUDGET = 200 * 1024  # of the 227 KiB an H100 / H200 program may take; the rest for Triton's scratch
# A program's fixed cost (first loads' latency, epilogue) as bytes an SM reads meanwhile (quantized_gemm's).
PROGRAM_OVERHEAD_BYTES = 64 * 1024
# The quantizing kernel holds a row of up to this many elements in registers (one load, one store).
MAX_QUANT_BLOCK = 16384
_E4M3_MAX = tl.constexpr(FP8_MAX)
_INT8_MAX = tl.constexpr(INT8_MAX)
_SCALE_FLOOR = tl.constexpr(FP32_TINY)
_INT8 = tl.constexpr(_FORMAT_IDS["int8"])
# 1.5 · 2^23: v + this lies in [2^23, 2^24), where fp32's step is 1, so the add rounds |v| < 2^22 to
# an integer, ties to even (the constant is even); subtracting it back is exact.
_ROUNDER = tl.constexpr(12582912.0)

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _e4m3(v, EXACT: tl.constexpr):
    """fp32 values within ±448 as float8e4nv, rounded to nearest even. EXACT: in integer arithmetic
    (for the interpreter): a normal result is the fp32 bits rounded to 3 mantissa bits, the exponent
    rebiased (127 -> 7) by subtracting 120 << 3; below 2^-6 the code is round(|v| · 2^9)."""
    if EXACT:
        bits = v.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
        sub = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # + 2^23: fp32 adds round to even
        code = tl.where(mag >= 0x3C800000, normal - 960, sub) | ((bits >> 24) & 0x80)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _row_scale(amax, FORMAT: tl.constexpr):
    """s_m of a row from its amax: the largest code stands for amax, floored at FP32_TINY."""
    if FORMAT == _INT8:
        return tl.maximum(tl.math.div_rn(amax, _INT8_MAX), _SCALE_FLOOR)
    else:
        return tl.maximum(tl.math.div_rn(amax, _E4M3_MAX), _SCALE_FLOOR)


@triton.jit
def _row_codes(x, scale, FORMAT: tl.constexpr, EXACT: tl.constexpr):
    """x / s_m (fp32, rounded division) as the format's codes: int8 rounded to nearest even within
    ±127, e4m3 within ±448 (`_e4m3`)."""
    if FORMAT == _INT8:
        v = tl.clamp(tl.math.div_rn(x, scale), -_INT8_MAX, _INT8_MAX)
        return ((v + _ROUNDER) - _ROUNDER).to(tl.int8)
    else:
        return _e4m3(tl.clamp(tl.math.div_rn(x, scale), -_E4M3_MAX, _E4M3_MAX), EXACT)


@triton.jit
def _quantize_rows_kernel(X, G, XQ, XS, K, KP, stride_xm, eps, FORMAT: tl.constexpr, BLOCK: tl.constexpr,
                          ONE_BLOCK: tl.constexpr, EXACT: tl.constexpr, INT4_ORDER: tl.constexpr,
                          NORM: tl.constexpr, USE_PDL: tl.constexpr):
    # A program a row. Output column b of a 64-column block holds element 16·(b % 4) + (b % 64) // 4 of
    # it (the 8-bit weight's byte order), so each block is gathered from the same 64 elements of x.
    # INT4_ORDER (int8 codes for an int4 weight, quantized_gemv_a8): column b of a 128-column block is
    # byte b % 4 of word (b % 128) // 4, whose first 16 words hold the even codes' elements 32·j + i of
    # the block and the next 16 the odd codes', 32·j + 16 + i (i = word % 16).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if INT4_ORDER:
        src = (cols // 128) * 128 + (cols % 4) * 32 + ((cols % 128) // 64) * 16 + (cols % 64) // 4
    else:
        src = (cols // 64) * 64 + (cols % 4) * 16 + (cols % 64) // 4
    x_row = X + row * stride_xm
    q_row = XQ + row * KP
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    # NORM: the row is an RMSNorm's input. Its codes are those of x · g (the norm's weight), and its stored
    # scale takes the norm's 1 / rms(x) as well: the codes of x · g / rms(x) would be the same, scale aside.
    if ONE_BLOCK:
        x = tl.load(x_row + src, mask=src < K, other=0.0).to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
            x *= tl.load(G + src, mask=src < K, other=0.0).to(tl.float32)
        scale = _row_scale(tl.max(tl.abs(x), axis=0), FORMAT)
        q = _row_codes(x, scale, FORMAT, EXACT)
        tl.store(q_row + cols, q, mask=cols < KP)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            if NORM:
                sq += x * x
                x *= tl.load(G + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = _row_scale(tl.max(amax, axis=0), FORMAT)
        if NORM:
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        for b0 in range(0, KP, BLOCK):
            x = tl.load(x_row + b0 + src, mask=b0 + src < K, other=0.0).to(tl.float32)
            if NORM:
                x *= tl.load(G + b0 + src, mask=b0 + src < K, other=0.0).to(tl.float32)
            q = _row_codes(x, scale, FORMAT, EXACT)
            tl.store(q_row + b0 + cols, q, mask=b0 + cols < KP)
    if NORM:
        scale *= rstd
    tl.store(XS + row, scale)


@triton.jit
def _store_y(acc, WS, XS, B, Y, rows, row_ok, ms, m_ok, stride_ym, HAS_BIAS: tl.constexpr):
    """The tile's sums [BLOCK_N, BLOCK_M] as y [M, N]: both scales, bias, x's dtype."""
    acc = acc * tl.load(WS + rows)[:, None] * tl.load(XS + ms)[None, :]
    if HAS_BIAS:
        acc += tl.load(B + rows).to(tl.float32)[:, None]
    tl.store(Y + ms[None, :].to(tl.int64) * stride_ym + rows[:, None], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & m_ok[None, :])


@triton.jit
def _w8a8_kernel(
    XQ, XS, Wq, WS, B, Y, PARTS, COUNTS, M, N, KP, stride_ym,
    FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr, DOT_FP32: tl.constexpr,
):
    # Grid (x's row tiles, W's row tiles, splits): the programs reading one tile of W run side by side.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows, row_ok = clamped_rows(pid_n, BLOCK_N, N)
    ms, m_ok = clamped_rows(pid_m, BLOCK_M, M)
    ks = tl.arange(0, BLOCK_K)
    # The packed int32 words read as their bytes: code j of word i is byte 4·i + j (little-endian);
    # int8's unsigned (q + 128), fp8's e4m3.
    if FORMAT == _INT8:
        w_bytes = Wq.to(tl.pointer_type(tl.uint8), bitcast=True)
    else:
        w_bytes = Wq.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    w_ptrs = w_bytes + rows[:, None].to(tl.int64) * KP + ks[None, :]
    xt_ptrs = XQ + ms[None, :].to(tl.int64) * KP + ks[:, None]
    # This split's steps: a contiguous run; the splits' runs differ by one step at most.
    n_steps = KP // BLOCK_K
    first = split * n_steps // SPLIT_K
    end = (split + 1) * n_steps // SPLIT_K
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x's codes are the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    if FORMAT == _INT8:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(first, end):
        w = tl.load(w_ptrs + step * BLOCK_K)
        xt = tl.load(xt_ptrs + step * BLOCK_K)
        if FORMAT == _INT8:
            acc = tl.dot((w ^ 0x80).to(tl.int8, bitcast=True), xt, acc, out_dtype=tl.int32)
        elif DOT_FP32:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc, max_num_imprecise_acc=BLOCK_K)
    acc = acc.to(tl.float32)  # int8's int32 sums (exact up to 2^24, then rounded once); fp8's as they are
    if SPLIT_K == 1:
        _store_y(acc, WS, XS, B, Y, rows, row_ok, ms, m_ok, stride_ym, HAS_BIAS)
    else:
        # Only the rows and columns y keeps are written and read.
        tile = pid_n * tl.num_programs(0) + pid_m
        last, total = reduce_splits(acc, PARTS, COUNTS, tile, row_ok[:, None] & m_ok[None, :], split, SPLIT_K)
        if last:
            _store_y(total, WS, XS, B, Y, rows, row_ok, ms, m_ok, stride_ym, HAS_BIAS)


# --------------------------------------------------------------------------------------------
# Config rule and launchers
# --------------------------------------------------------------------------------------------


def w8a8_shared_bytes(block_m: int, block_n: int, block_k: int, num_stages: int) -> int:
    """Shared memory of a program's pipeline: per stage a tile of W's and of x's codes, a byte each."""
    return num_stages * (block_n + block_m) * block_k


def _bytes_per_sm(m: int, n: int, kp: int, sms: int, block_m: int, block_n: int, split_k: int) -> int:
    """What the busiest SM reads for one product: its programs (one a wave) times a program's slice of
    x's and W's codes and (when it reduces) the other splits' partials, plus a fixed cost a wave."""
    rows = min(m, block_m)
    programs = cdiv(m, block_m) * cdiv(n, block_n) * split_k
    partials = (split_k - 1) * block_n * rows * 4
    return cdiv(programs, sms) * ((rows + block_n) * kp // split_k + partials + PROGRAM_OVERHEAD_BYTES)


@functools.lru_cache(maxsize=1024)
def w8a8_config(m: int, n: int, kp: int, sms: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for m rows of x, n of W, kp bytes a row.

    - BLOCK_M: x's rows padded to a power of two, 16 (the MMA's narrow side) to MAX_BLOCK_M.
    - BLOCK_N (64, 128, 256; BLOCK_N · BLOCK_M within MAX_ACCUMULATORS) and SPLIT_K (1 to MAX_SPLIT_K,
      64 bytes of the row each at least): the pair whose busiest SM reads the fewest bytes
      (`_bytes_per_sm`; from 2 rows x's rows count as BLOCK_M's, so that the pick depends on BLOCK_M
      alone): narrow tiles of W re-read x from L2, splits fill SMs the tiles of W leave idle but add
      partials, a wave more costs a program's fixed cost. Ties go to fewer splits, then wider
      tiles. Large m (prefill) ends at the largest tiles and one split.
    - BLOCK_K: 128 where it divides the row and leaves each split a step, else 64 (Kp is whole 64s).
    - num_warps: 8 from 8192 accumulators (two warpgroups), else 4.
    - num_stages: MAX_STAGES, fewer if the pipeline would pass SHARED_BUDGET.
    """
    block_m = min(MAX_BLOCK_M, max(16, next_power_of_2(m)))
    # Past one row, x's rows count as the whole tile's: a batch and the CUDA-graph bucket that pads it (the
    # same power of two) then take one config, so that fp8's fp32 sums, whose order split-K sets, agree.
    counted = m if m == 1 else max(m, block_m)
    splits = [s for s in (1, 2, 4, 8) if s <= min(MAX_SPLIT_K, kp // 64)]
    _, split_k, block_n = min((_bytes_per_sm(counted, n, kp, sms, block_m, bn, s), s, -bn)
                              for bn in BLOCK_NS if bn * block_m <= MAX_ACCUMULATORS for s in splits)
    block_n = -block_n
    block_k = next(bk for bk in BLOCK_KS if kp % bk == 0 and kp // bk >= split_k)
    num_stages = next((s for s in range(MAX_STAGES, 1, -1)
                       if w8a8_shared_bytes(block_m, block_n, block_k, s) <= SHARED_BUDGET), 2)
    return block_m, block_n, block_k, split_k, 8 if block_n * block_m >= 8192 else 4, num_stages


def quantize_rows(x2: torch.Tensor, kp: int, fmt: str,
                  norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] (unit column stride) as codes [M, kp] for a weight of `fmt` ("int8": torch.int8,
    "fp8": float8_e4m3fn, both in the packed weight's byte order; "int4": int8 codes in the order of
    quantized_gemv_a8), zero padded, and their scales [M] fp32 (module docstring). One launch.
    With `norm` = (weight [K], eps), the rows of RMSNorm(x2) instead: codes of x2 · weight, each scale
    times that row's 1 / rms."""
    m, k = x2.shape
    codes = torch.empty(m, kp, device=x2.device, dtype=torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
    scales = torch.empty(m, device=x2.device, dtype=torch.float32)
    block = min(MAX_QUANT_BLOCK, next_power_of_2(kp))
    pdl = use_pdl(x2.device)
    g, eps = (None, 0.0) if norm is None else norm
    launch(_quantize_rows_kernel, (m,), x2, g, codes, scales, k, kp, x2.stride(0), eps,
           FORMAT=_FORMAT_IDS["fp8" if fmt == "fp8" else "int8"], BLOCK=block, ONE_BLOCK=block >= kp,
           EXACT=INTERPRETED, INT4_ORDER=fmt == "int4", NORM=norm is not None, USE_PDL=pdl,
           num_warps=max(1, min(16, block // 1024)), num_stages=1, launch_pdl=pdl)
    return codes, scales


def launch_w8a8(x2: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, y2: torch.Tensor,
                config: tuple[int, int, int, int, int, int] | None = None,
                counters: torch.Tensor | None = None, norm: tuple[torch.Tensor, float] | None = None) -> None:
    """y2 [M, N] = quantize(x2) · Wᵀ (+ bias) for an int8 or fp8 weight, x2 quantized to the weight's
    format; inputs checked by the caller (quantized_linear): x2 [M, K] with unit column stride, y2
    contiguous in x2's dtype.

    config: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), w8a8_config's by default.
    counters: int32, one per output tile, at zero (the kernel leaves them at zero); by default the
    weight's own, else a fresh torch.zeros per call with split-K (quantized_gemm.launch_gemm says why),
    allocated before x is quantized, so that its memset does not stand between the two kernels'
    dependent launch. norm: (weight, eps): x2's rows are an RMSNorm's input (quantize_rows)."""
    if weight.fmt not in W8A8_FORMATS:
        raise ValueError(f"launch_w8a8 takes an int8 or fp8 weight, got {weight.fmt}")
    m, n, n_words = x2.shape[0], weight.out_features, weight.data.shape[1]
    kp = 4 * n_words
    block_m, block_n, block_k, split_k, num_warps, num_stages = config or w8a8_config(m, n, kp, sm_count(x2.device))
    if block_k % 32 or kp % block_k:
        raise ValueError(f"BLOCK_K={block_k} must be a multiple of 32 dividing the row's {kp} bytes")
    grid = (cdiv(m, block_m), cdiv(n, block_n), split_k)
    if split_k == 1:
        parts = counters = y2  # not read: one split stores y itself
    else:
        tiles = grid[0] * grid[1]
        counters = tile_counters(weight.counters if counters is None else counters, tiles, x2.device)
        parts = torch.empty(tiles * split_k * block_n * block_m, device=x2.device, dtype=torch.float32)
    codes, scales = quantize_rows(x2, kp, weight.fmt, norm)
    pdl = use_pdl(x2.device)
    launch(_w8a8_kernel, grid,
        codes, scales, weight.data, weight.scales, weight.scales if bias is None else bias,
        y2, parts, counters, m, n, kp, y2.stride(0),
        FORMAT=_FORMAT_IDS[weight.fmt], HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, USE_PDL=pdl, DOT_FP32=INTERPRETED, num_warps=num_warps,
        num_stages=num_stages, launch_pdl=pdl,
    )

