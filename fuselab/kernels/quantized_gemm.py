"""y = x · Wᵀ (+ b) on the tensor cores for a few rows of x (quantized_linear's path from 2 to
FUSED_MAX_ROWS rows), the packed weight (quant_pack) dequantized in registers, never written back.

A program owns a tile of y^T: BLOCK_N rows of W (the MMA's M side: 64, 128 or 256) by BLOCK_M rows
of x (16 to 128; rows of x past M and of W past N are clamped to the last one, their results not
stored, so no load of W is masked). It walks its share of K BLOCK_W words a step. For each code
position j, a step is a [BLOCK_N, BLOCK_W] operand of x's dtype and the slice of x^T its columns
multiply, [BLOCK_W, BLOCK_M], one tl.dot accumulating in fp32. Code j of word i is element 16·j + i
of its block, so the slice is x gathered in runs of 16: the sum over K does not depend on its order.

- int4: code · scale is dequantized in registers before the dot (one scale per row and group,
  rounded to x's dtype as `reference_quant.dequantize(w, x.dtype)` rounds it), so a step may span
  blocks and groups: groups of 32 and 64 change inside a block, between codes j. int8 / fp8: the
  exact codes are the operand; the per-channel scale multiplies the sums after the loop.
- split-K: SPLIT_K programs share an output tile, each walking a contiguous run of its steps, so
  that projections with few tiles of W still give every SM a program. The reduction is in the same
  kernel: each split stores its fp32 partial tile to a workspace, then takes a ticket from the
  tile's counter; the split drawing the last one adds the partials in split order (the same sum
  whichever split ends last: deterministic), applies scales and bias, stores y and sets the counter
  back to zero (`_common.split_k.reduce_splits`). SPLIT_K = 1 stores y directly, with no workspace.

`gemm_config` picks the tile and the split whose busiest SM reads the fewest bytes: its programs'
slices of x (which every tile of W reads again, from L2) and of W, the partials a reducing split
reads, and a fixed cost a wave; so it fills the SMs where that is cheaper than x's traffic.

int4 with bf16 or fp16 activations runs `_gemm_int4_wide_kernel` (gemm_config's 7th element,
GEMM_VARIANTS): one tl.dot a step over the step's elements in their own order, so that the codes are
extracted where the MMA reads them from registers (no shared-memory round trip, no barrier per code
position), dequantized two at a time in bf16x2 registers where x and the scales are bf16
("wide-bf16x2", quant_codes._int4_bf16x2), else in fp32 as above ("wide"). On the Llama 3 8B
projections at 16 and 64 rows its best config was 1.3-2.6x faster than the per-code kernel's
(scripts/tune-quant-gemv).
fp32 activations keep the per-code kernel: a tf32 operand goes through shared memory, a whole step of it.
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
from fuselab.kernels.quant_codes import MAGIC, _FORMAT_IDS, _codes, _high_half, _int4_bf16x2
from fuselab.kernels.quant_pack import BLOCK_WORDS, QuantizedWeight, block_elements, values_per_word

MAX_BLOCK_M = 128
MAX_SPLIT_K = 8
# W words a step holds in registers (BLOCK_N · BLOCK_W), and as many of their shifted copy: 64
# registers a thread at 8 warps, next to the accumulator and the operand.
MAX_STEP_WORDS = 8192
# Shared memory the rule lets a program's pipeline take: H100 / H200 give a program up to 227 KiB;
# the rest is left to Triton's own scratch (layout conversions, the epilogue).
SHARED_BUDGET = 200 * 1024
NUM_STAGES = 3
# A program's fixed cost (the latency of its first loads, its epilogue) counted as the bytes an SM
# reads meanwhile, so that a second wave of programs is not free in gemm_config's count.
PROGRAM_OVERHEAD_BYTES = 64 * 1024
# The kernels launch_gemm's config may name (its 7th element, an index here): "per-code",
# _gemm_kernel (one tl.dot a code position); int4 only, _gemm_int4_wide_kernel (one tl.dot a step):
# "wide" dequantizes in fp32 as _gemm_kernel does, "wide-bf16x2" in bf16 pairs where x and the
# scales are bf16 (else as "wide"). gemm_config picks "wide-bf16x2" for int4 with 16-bit x.
GEMM_VARIANTS = ("per-code", "wide", "wide-bf16x2")
WIDE_INT4 = GEMM_VARIANTS.index("wide-bf16x2")

# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _operand(w, hi, magic, j: tl.constexpr, FORMAT: tl.constexpr, DTYPE: tl.constexpr):
    """Code j of an 8-bit format as a tl.dot operand of DTYPE, exactly (integers up to 255 and e4m3
    values fit bf16 and fp16)."""
    if FORMAT == 2 and DTYPE != tl.float32:
        return ((w >> (8 * j)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DTYPE)
    else:
        return _codes(w, hi, magic, j, FORMAT).to(DTYPE)


@triton.jit
def _store_y(acc, S, B, Y, rows, row_ok, ms, m_ok, stride_ym, FORMAT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The tile's sums [BLOCK_N, BLOCK_M] as y [M, N]: per-channel scale (8-bit formats), bias, x's dtype."""
    if FORMAT != 0:
        acc *= tl.load(S + rows)[:, None]
    if HAS_BIAS:
        acc += tl.load(B + rows).to(tl.float32)[:, None]
    tl.store(Y + ms[None, :].to(tl.int64) * stride_ym + rows[:, None], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & m_ok[None, :])


@triton.jit
def _gemm_kernel(
    X, Wq, S, B, Y, WS, COUNTS, M, N, K, n_words, stride_xm, stride_ym, stride_sn, magic,
    FORMAT: tl.constexpr, PER_WORD: tl.constexpr, GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    # Grid (x's row tiles, W's row tiles, splits): the programs reading one tile of W run side by
    # side. The operand of code j is [BLOCK_N, BLOCK_W]: its column c multiplies element 16·j + c % 16
    # of block c // 16 (x_offsets). The 8-bit formats load it as it is (a reshape between the load and
    # the dot costs a layout conversion a step: 8-25% at 64 rows); int4 loads [BLOCK_N, BLOCKS, 16], so
    # that a scale, one per row and block for a code j, broadcasts along the last axis, and reshapes
    # after dequantizing (scales gathered per column instead cost more). GROUPS: int4 scale groups a
    # block (1 for the 8-bit formats).
    ELEMS: tl.constexpr = 16 * PER_WORD
    BLOCKS: tl.constexpr = BLOCK_W // 16
    CODES_PER_GROUP: tl.constexpr = PER_WORD // GROUPS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows, row_ok = clamped_rows(pid_n, BLOCK_N, N)
    ms, m_ok = clamped_rows(pid_m, BLOCK_M, M)
    cols = tl.arange(0, BLOCK_W)
    if FORMAT == 0:
        blocks = tl.arange(0, BLOCKS)
        words = blocks[:, None] * 16 + tl.arange(0, 16)[None, :]
        w_ptrs = Wq + rows[:, None, None].to(tl.int64) * n_words + words[None, :, :]
    else:
        w_ptrs = Wq + rows[:, None].to(tl.int64) * n_words + cols[None, :]
    x_offsets = (cols // 16) * ELEMS + cols % 16
    xt_ptrs = X + ms[None, :].to(tl.int64) * stride_xm + x_offsets[:, None]
    # This split's steps: a contiguous run; the splits' runs differ by one step at most.
    n_steps = n_words // BLOCK_W
    first = split * n_steps // SPLIT_K
    end = (split + 1) * n_steps // SPLIT_K
    if FORMAT == 0:
        # A step's scales [BLOCK_N, BLOCKS, GROUPS] are requested a step before they are used (too
        # few bytes a thread for the pipeliner to stage them), the first before the wait on the
        # kernel before: they are weights. Clamped to the row's last step (a split may have none).
        groups = tl.arange(0, GROUPS)
        s_ptrs = (S + rows[:, None, None].to(tl.int64) * stride_sn
                  + (blocks[:, None] * GROUPS + groups[None, :])[None, :, :])
        s_next = tl.load(s_ptrs + tl.minimum(first, n_steps - 1) * (BLOCKS * GROUPS))
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    dtype = X.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(first, end):
        w = tl.load(w_ptrs + step * BLOCK_W)
        hi = _high_half(w, FORMAT)
        if FORMAT == 0:
            s_step = s_next.to(tl.float32)
            s_next = tl.load(s_ptrs + tl.minimum(step + 1, n_steps - 1) * (BLOCKS * GROUPS))
        k0 = step * (BLOCKS * ELEMS)
        for j in tl.static_range(PER_WORD):
            if EVEN_K:
                xt = tl.load(xt_ptrs + (k0 + j * 16))
            else:
                xt = tl.load(xt_ptrs + (k0 + j * 16), mask=(k0 + j * 16 + x_offsets < K)[:, None], other=0.0)
            if FORMAT == 0:
                if j % CODES_PER_GROUP == 0:  # code j starts a group: its scale, [BLOCK_N, BLOCKS, 1]
                    if GROUPS == 1:
                        scale = s_step
                    else:
                        scale = tl.sum(tl.where(groups[None, None, :] == j // CODES_PER_GROUP, s_step, 0.0),
                                       axis=2, keep_dims=True)
                # q · s is exact in fp32 (a 4-bit q, a bf16 or fp16 scale): one rounding, to x's dtype.
                a = tl.reshape((_codes(w, hi, magic, j, FORMAT) * scale).to(dtype), (BLOCK_N, BLOCK_W))
            else:
                a = _operand(w, hi, magic, j, FORMAT, dtype)
            if DOT_FP32:
                a, xt = a.to(tl.float32), xt.to(tl.float32)
            acc = tl.dot(a, xt, acc, input_precision=PRECISION)
    if SPLIT_K == 1:
        _store_y(acc, S, B, Y, rows, row_ok, ms, m_ok, stride_ym, FORMAT, HAS_BIAS)
    else:
        # Only the rows and columns y keeps are written and read.
        tile = pid_n * tl.num_programs(0) + pid_m
        last, total = reduce_splits(acc, WS, COUNTS, tile, row_ok[:, None] & m_ok[None, :], split, SPLIT_K)
        if last:
            _store_y(total, S, B, Y, rows, row_ok, ms, m_ok, stride_ym, FORMAT, HAS_BIAS)


@triton.jit
def _code_pair_scales(s_step, GROUPS: tl.constexpr):
    """A step's scales [BLOCK_N, BLOCKS, GROUPS] as those of codes 0-1, 2-3, 4-5, 6-7, each
    [BLOCK_N, BLOCKS, 1] (code j's group is j · GROUPS // 8)."""
    if GROUPS == 1:
        return s_step, s_step, s_step, s_step
    elif GROUPS == 2:
        low, high = tl.split(s_step)
        return low[:, :, None], low[:, :, None], high[:, :, None], high[:, :, None]
    else:
        even, odd = tl.split(tl.reshape(s_step, (s_step.shape[0], s_step.shape[1], 2, 2)))  # groups 0, 2 | 1, 3
        s0, s2 = tl.split(even)
        s1, s3 = tl.split(odd)
        return s0[:, :, None], s1[:, :, None], s2[:, :, None], s3[:, :, None]


@triton.jit
def _wide_operand(w, s0, s1, s2, s3, magic, DTYPE: tl.constexpr, BF16X2: tl.constexpr):
    """A step's words [BLOCK_N, BLOCKS, 16] as the [BLOCK_N, 128 · BLOCKS] operand of DTYPE, its
    columns the elements in their own order (element 16·j + i of a block is code j of word i);
    s0-s3 [BLOCK_N, BLOCKS, 1]: the scales of codes 0-1, 2-3, 4-5 and 6-7."""
    if BF16X2:
        c0, c1, c2, c3, c4, c5, c6, c7 = _int4_bf16x2(w, magic, s0, s0, s1, s1, s2, s2, s3, s3)
    else:
        hi = _high_half(w, 0)
        s0, s1, s2, s3 = s0.to(tl.float32), s1.to(tl.float32), s2.to(tl.float32), s3.to(tl.float32)
        # q · s is exact in fp32 (a 4-bit q, a bf16 or fp16 scale): one rounding, to x's dtype.
        c0 = (_codes(w, hi, magic, 0, 0) * s0).to(DTYPE)
        c1 = (_codes(w, hi, magic, 1, 0) * s0).to(DTYPE)
        c2 = (_codes(w, hi, magic, 2, 0) * s1).to(DTYPE)
        c3 = (_codes(w, hi, magic, 3, 0) * s1).to(DTYPE)
        c4 = (_codes(w, hi, magic, 4, 0) * s2).to(DTYPE)
        c5 = (_codes(w, hi, magic, 5, 0) * s2).to(DTYPE)
        c6 = (_codes(w, hi, magic, 6, 0) * s3).to(DTYPE)
        c7 = (_codes(w, hi, magic, 7, 0) * s3).to(DTYPE)
    # [BLOCK_N, BLOCKS, 16, j2, j1, j0] -> [BLOCK_N, BLOCKS, j, 16]: joins and permutes move no data,
    # so the layout Triton gives the dot's operand reaches back to the words' load (see the kernel).
    a = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(tl.permute(a, (0, 1, 3, 4, 5, 2)), (w.shape[0], 128 * w.shape[1]))


@triton.jit
def _gemm_int4_wide_kernel(
    X, Wq, S, B, Y, WS, COUNTS, M, N, K, n_words, stride_xm, stride_ym, stride_sn, magic,
    GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, BF16X2: tl.constexpr,
):
    # _gemm_kernel's int4 path with one tl.dot a step instead of one a code position: the operand is
    # the step's 128 · BLOCKS elements in their own order, so x^T's slice is a plain run of K (no
    # gather) and a thread's share of the operand is whole words it loads itself: Triton carries the
    # operand's register layout back through the reshape to the load of the words, the codes become
    # the MMA's register operand where they are extracted (no trip through shared memory, no barrier
    # a code position), and the MMAs of a step are issued back to back. BF16X2: codes to bf16 pairs
    # in inline PTX (`_int4_bf16x2`), for bf16 x and bf16 scales; else fp32 as _gemm_kernel.
    BLOCKS: tl.constexpr = BLOCK_W // 16
    BLOCK_K: tl.constexpr = 128 * BLOCKS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows, row_ok = clamped_rows(pid_n, BLOCK_N, N)
    ms, m_ok = clamped_rows(pid_m, BLOCK_M, M)
    blocks = tl.arange(0, BLOCKS)
    words = blocks[:, None] * 16 + tl.arange(0, 16)[None, :]
    w_ptrs = Wq + rows[:, None, None].to(tl.int64) * n_words + words[None, :, :]
    ks = tl.arange(0, BLOCK_K)
    xt_ptrs = X + ms[None, :].to(tl.int64) * stride_xm + ks[:, None]
    n_steps = n_words // BLOCK_W
    first = split * n_steps // SPLIT_K
    end = (split + 1) * n_steps // SPLIT_K
    s_ptrs = (S + rows[:, None, None].to(tl.int64) * stride_sn
              + (blocks[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :])[None, :, :])
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    dtype = X.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(first, end):
        w = tl.load(w_ptrs + step * BLOCK_W)
        # The step's scales [BLOCK_N, BLOCKS, GROUPS], loaded in the step (not a step ahead as
        # _gemm_kernel does) and split per group (not picked by a reduction): Triton carries the
        # operand's layout back to a load, not to a value carried by the loop, and a split moves no data.
        s_step = tl.load(s_ptrs + step * (BLOCKS * GROUPS))
        s0, s1, s2, s3 = _code_pair_scales(s_step, GROUPS)
        k0 = step * BLOCK_K
        if EVEN_K:
            xt = tl.load(xt_ptrs + k0)
        else:
            xt = tl.load(xt_ptrs + k0, mask=(k0 + ks < K)[:, None], other=0.0)
        a = _wide_operand(w, s0, s1, s2, s3, magic, dtype, BF16X2)
        if DOT_FP32:
            a, xt = a.to(tl.float32), xt.to(tl.float32)
        acc = tl.dot(a, xt, acc, input_precision=PRECISION)
    if SPLIT_K == 1:
        _store_y(acc, S, B, Y, rows, row_ok, ms, m_ok, stride_ym, 0, HAS_BIAS)
    else:
        tile = pid_n * tl.num_programs(0) + pid_m
        last, total = reduce_splits(acc, WS, COUNTS, tile, row_ok[:, None] & m_ok[None, :], split, SPLIT_K)
        if last:
            _store_y(total, S, B, Y, rows, row_ok, ms, m_ok, stride_ym, 0, HAS_BIAS)


# --------------------------------------------------------------------------------------------
# Config rule and launcher
# --------------------------------------------------------------------------------------------


def gemm_shared_bytes(block_m: int, block_n: int, block_w: int, fmt: str, num_stages: int, x_bytes: int = 2,
                      variant: int = 0) -> int:
    """Shared memory a program's pipeline takes, estimated: per stage a step's words of W and the
    x^T slices of its code positions; once, the dequantized operand on its way to the MMA's layout:
    a code position's for the per-code kernel, none for the wide kernel at 16-bit x (registers), a
    whole step's at fp32 x."""
    step = block_n * block_w * 4 + values_per_word(fmt) * block_w * block_m * x_bytes
    if variant == 0:
        operand = block_n * block_w * x_bytes
    else:
        operand = 0 if x_bytes == 2 else values_per_word(fmt) * block_n * block_w * x_bytes
    return num_stages * step + operand


def _bytes_per_sm(m: int, n: int, n_words: int, fmt: str, sms: int, x_bytes: int, block_m: int, block_n: int,
                  split_k: int) -> int:
    """What the busiest SM reads for one product at this tile: its programs (one a wave) times a
    program's x slice, W slice and (when it reduces) the other splits' partials, plus a fixed cost a wave."""
    rows = min(m, block_m)
    programs = cdiv(m, block_m) * cdiv(n, block_n) * split_k
    x = rows * x_bytes * n_words * values_per_word(fmt) // split_k
    w = block_n * n_words * 4 // split_k
    partials = (split_k - 1) * block_n * rows * 4
    return cdiv(programs, sms) * (x + w + partials + PROGRAM_OVERHEAD_BYTES)


@functools.lru_cache(maxsize=1024)
def gemm_config(m: int, n: int, n_words: int, fmt: str, sms: int, x_bytes: int = 2) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_W, SPLIT_K, num_warps, num_stages) for m rows of x, n of W, n_words a
    row, and for int4 at 16-bit x a 7th element, WIDE_INT4 (its kernel).

    - BLOCK_M: x's rows padded to a power of two, 16 (the MMA's narrow side) to MAX_BLOCK_M.
    - BLOCK_N (64, 128, 256) and SPLIT_K (1 to MAX_SPLIT_K, a block of the row each at least): the
      pair whose busiest SM reads the fewest bytes (`_bytes_per_sm`). Every program reads its slice
      of x from L2 (narrow tiles of W multiply x's traffic, up to several times the weight's bytes),
      split-K fills SMs that the tiles of W alone leave idle but its reducing program reads the
      other splits' partials after the rest are done, and a wave more costs a program's fixed cost.
      Ties go to fewer splits, then wider tiles.
    - BLOCK_W: the longest step of 64, 32, 16 words dividing the row, each split a step at least,
      within MAX_STEP_WORDS of registers and, at NUM_STAGES, SHARED_BUDGET (else 16 words, 2 stages).
    - num_warps: gemm_num_warps.
    - int4 at 16-bit x: the wide kernel, its operand in registers (gemm_shared_bytes), and no tiles
      of 256 rows of W at 16 rows of x (2-3x slower than 128 there, on the Llama 3 8B projections);
      at up to 16 rows with more tiles of W than SMs, 32-word steps first and 4 warps.
    """
    wide = fmt == "int4" and x_bytes == 2
    variant = WIDE_INT4 if wide else 0
    block_m = min(MAX_BLOCK_M, max(16, next_power_of_2(m)))
    splits = [s for s in (1, 2, 4, 8) if s <= min(MAX_SPLIT_K, n_words // BLOCK_WORDS)]
    widths = (64, 128) if wide and block_m == 16 else (64, 128, 256)
    _, split_k, block_n = min(
        (_bytes_per_sm(m, n, n_words, fmt, sms, x_bytes, block_m, bn, s), s, -bn) for bn in widths for s in splits)
    block_n = -block_n
    # More than a wave of tiles of W at the wide kernel's 16 rows: 32-word steps at 4 warps leave room for
    # 3 programs an SM, whose loads hide each other's latency (gate/up and lm_head at 1 and 16 rows: 8-16% faster).
    many_tiles = wide and block_m == 16 and split_k == 1 and cdiv(n, block_n) > sms
    num_stages = NUM_STAGES
    for block_w in (32, 64, 16) if many_tiles else (64, 32, 16):
        if (n_words % block_w == 0 and n_words // block_w >= split_k and block_n * block_w <= MAX_STEP_WORDS
                and gemm_shared_bytes(block_m, block_n, block_w, fmt, num_stages, x_bytes, variant) <= SHARED_BUDGET):
            break
    else:
        num_stages = 2
    num_warps = 4 if many_tiles else gemm_num_warps(block_m, block_n, block_w)
    config = (block_m, block_n, block_w, split_k, num_warps, num_stages)
    return config + (variant,) if wide else config


def gemm_num_warps(block_m: int, block_n: int, block_w: int) -> int:
    """8 warps for tiles of 8192 accumulators or step words (64 registers a thread for each), else 4."""
    return 8 if block_n * max(block_m, block_w) >= 8192 else 4


def launch_gemm(x2: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, y2: torch.Tensor,
                config: tuple[int, ...] | None = None, counters: torch.Tensor | None = None) -> None:
    """y2 [M, N] = x2 [M, K] · dequantize(weight)ᵀ (+ bias), inputs checked by the caller (quantized_linear).

    config: (BLOCK_M, BLOCK_N, BLOCK_W, SPLIT_K, num_warps, num_stages), gemm_config's by default,
    and optionally a 7th element, the kernel: an index into GEMM_VARIANTS (0 when left out; the
    others int4 only).
    counters: int32, one per output tile (cdiv(M, BLOCK_M) · cdiv(N, BLOCK_N)), at zero; the kernel
    leaves them at zero, so a caller may keep one buffer for its calls on one stream. By default the
    weight's own (`QuantizedWeight.counters`, which the engine's layers carry), else a fresh torch.zeros
    per call with split-K: a buffer kept by this module would be shared by every stream and graph (two
    replaying at once would mix their tickets), and inside a CUDA graph the zeroing is one small node
    before the kernel (it does stand between the kernel before and this one, whose programmatic
    dependent launch then waits for it)."""
    m, n, k, n_words = x2.shape[0], weight.out_features, weight.in_features, weight.data.shape[1]
    fmt = weight.fmt
    config = config or gemm_config(m, n, n_words, fmt, sm_count(x2.device), x2.element_size())
    block_m, block_n, block_w, split_k, num_warps, num_stages = config[:6]
    variant = config[6] if len(config) > 6 else 0
    if block_w % BLOCK_WORDS or n_words % block_w:
        raise ValueError(f"BLOCK_W={block_w} must be a multiple of {BLOCK_WORDS} dividing the row's {n_words} words")
    if variant not in range(len(GEMM_VARIANTS)) or (variant and fmt != "int4"):
        raise ValueError(f"kernel {variant} of {GEMM_VARIANTS} does not take {fmt} (kernels past 0 are int4's)")
    grid = (cdiv(m, block_m), cdiv(n, block_n), split_k)
    if split_k == 1:
        workspace = counters = y2  # not read: one split stores y itself
    else:
        tiles = grid[0] * grid[1]
        workspace = torch.empty(tiles * split_k * block_n * block_m, device=x2.device, dtype=torch.float32)
        counters = tile_counters(weight.counters if counters is None else counters, tiles, x2.device)
    pdl = use_pdl(x2.device)
    # Triton's interpreter multiplies bfloat16 tl.dot operands wrongly; exact in fp32 instead.
    interpreted_bf16 = INTERPRETED and x2.dtype == torch.bfloat16
    args = (x2, weight.data, weight.scales, weight.scales if bias is None else bias, y2, workspace, counters,
            m, n, k, n_words, x2.stride(0), y2.stride(0), weight.scales.stride(0), MAGIC)
    groups = block_elements(fmt) // weight.group_size if fmt == "int4" else 1
    meta = dict(HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=block_w, SPLIT_K=split_k,
                EVEN_K=k % block_elements(fmt) == 0, USE_PDL=pdl,
                PRECISION="ieee" if x2.dtype == torch.float32 or interpreted_bf16 else "tf32",
                DOT_FP32=interpreted_bf16, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)
    if variant == 0:
        launch(_gemm_kernel, grid, *args, FORMAT=_FORMAT_IDS[fmt], PER_WORD=values_per_word(fmt), GROUPS=groups,
               **meta)
    else:
        bf16x2 = GEMM_VARIANTS[variant] == "wide-bf16x2" and x2.dtype == weight.scales.dtype == torch.bfloat16
        launch(_gemm_int4_wide_kernel, grid, *args, GROUPS=groups, BF16X2=bf16x2, **meta)
