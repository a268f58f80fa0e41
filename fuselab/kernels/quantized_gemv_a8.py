"""y = x · Wᵀ (+ b) for one row of x and an int4 (groups of 128) or int8 weight (quant_pack), with x
rounded per row to int8: W4A8 / W8A8 on the CUDA cores' integer dot products (quantized_linear's
one-row path for those formats).

Why: the fp32 GEMV (quantized_linear._gemv_kernel) spends ~5 instructions a weight (its sm_90 loop) turning codes into
floats and multiplying them, more than the SMs issue at the rate the weights arrive, so it reads them
at a third to a half of the copy bandwidth. `dp4a` multiplies four signed bytes by four and adds the
sums to an int32 in one instruction: with x's codes as int8, an int8 word costs one XOR and one dp4a
(4 weights), an int4 word a shift, two AND-XORs, two dp4a, a conversion and an FMA (8 weights).

- x: `quantize_rows` rounds the row to int8 codes (s = amax / 127, ties to even; W8A8's rounding),
  written in the order the weight's words take them: for int8 the weight's byte order (code j of
  word i pairs with byte j of x's word i); for int4, two words of x a word of W, the even codes' x
  and the odd codes' (`quantize_rows`' "int4" order).
- int8: a stored byte is q + 128; XOR 0x80 a byte gives q as a signed byte, and dp4a sums q · xq
  into int32 accumulators exactly (|sum| <= 127² · K < 2^31 up to K = 133143); one conversion a
  row, then both scales: y = acc · s_w[n] · s_x.
- int4: code j lies in bits 4j..4j+3 as q + 8. Masked into the high nibble of each byte (codes 1, 3,
  5, 7 as they lie; codes 0, 2, 4, 6 after a shift by 4) and XOR-ed with 0x80, a byte is 16 · q as a
  signed byte, so two dp4a give 16 · Σ q · xq over the word's 8 codes with no offset to undo. A
  group of 128 is one block of 16 words: the word's sum, as fp32, takes its group's scale in one
  FMA; y = acc · s_x / 16.
- The walk is the fp32 GEMV's: a program takes tiles of BLOCK_N rows of W in runs of BLOCK_B
  16-word blocks, requests the next run before it multiplies the current one, and programs walk
  tiles pid, pid + programs, ... so that each SM keeps a few runs in flight. For int4 a run's
  group scales and x's codes are requested with its words, a step ahead of their use.

Triton's interpreter has no inline assembly: there dp4a is spelled out in int32 arithmetic, the same
sums exactly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.launch import cdiv, sm_count, use_pdl
from fuselab.kernels.quant_codes import _PTX
from fuselab.kernels.quant_pack import BLOCK_WORDS, QuantizedWeight
from fuselab.kernels.quantized_gemm_w8a8 import quantize_rows

A8_INT4_GROUP = 128  # int4 groups this kernel takes: one group a 16-word block
A8_INT8_MAX_K = 133143  # int8's int32 sums are exact up to 127² · K < 2^31
# 0xF0F0F0F0 and 0x80808080 as int32: each byte's high nibble, and its sign bit. Kernel arguments, not
# literals, so that each stays in a register instead of being re-materialized for every LOP3.
HIGH_NIBBLES = 0xF0F0F0F0 - (1 << 32)
SIGN_BITS = 0x80808080 - (1 << 32)

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _dp4a(a, b, c):
    """c + Σ_j a_j · b_j over the four signed bytes of int32 words a and b (elementwise)."""
    if _PTX:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return (c + ((a << 24) >> 24) * ((b << 24) >> 24) + ((a << 16) >> 24) * ((b << 16) >> 24)
                + ((a << 8) >> 24) * ((b << 8) >> 24) + (a >> 24) * (b >> 24))


@triton.jit
def _gemv_a8_kernel(
    XQ, XS, Wq, S, B, R, Y, N, n_words, stride_sn, n_tiles, high_nibbles, sign_bits,
    INT4: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, RUNS: tl.constexpr, USE_PDL: tl.constexpr,
):
    # A tile: BLOCK_N rows of W, a run of BLOCK_B blocks of each at a time, [BLOCK_N, BLOCK_B, 16] as the
    # fp32 GEMV's, so that a thread's 4 words (one 16-byte load) share a group and x's words.
    BLOCK_W: tl.constexpr = 16 * BLOCK_B
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    steps = tl.cdiv(n_tiles - pid, programs) * RUNS
    lanes = tl.arange(0, 16)
    blocks = tl.arange(0, BLOCK_B)
    offsets = (blocks[:, None] * 16 + lanes[None, :])[None, :, :]
    if INT4:  # x's words of a block: the even codes' 16, then the odd codes' 16
        x_ptrs = XQ + (blocks[:, None] * 32 + lanes[None, :])[None, :, :]
    else:
        x_ptrs = XQ + offsets
    tile_rows = tl.arange(0, BLOCK_N)
    rows = tl.minimum(pid * BLOCK_N + tile_rows, N - 1)
    w = tl.load(Wq + rows[:, None, None].to(tl.int64) * n_words + offsets)
    if INT4:  # a run's group scales are weights too: the first run's before the wait
        s_ptrs = S + blocks[None, :]
        s = tl.load(s_ptrs + rows[:, None].to(tl.int64) * stride_sn)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x's codes are the kernel before's output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    x_scale = tl.load(XS)
    if INT4:
        x_even = tl.load(x_ptrs)
        x_odd = tl.load(x_ptrs + 16)
    zero = tl.zeros((BLOCK_N, BLOCK_B, 16), dtype=tl.int32)
    if INT4:
        acc = tl.zeros((BLOCK_N, BLOCK_B, 16), dtype=tl.float32)
    else:
        acc = zero
    for i in range(0, steps):
        nxt = tl.minimum(i + 1, steps - 1)
        next_rows = tl.minimum((pid + (nxt // RUNS) * programs) * BLOCK_N + tile_rows, N - 1)
        next_run = nxt % RUNS
        w_next = tl.load(Wq + next_rows[:, None, None].to(tl.int64) * n_words + offsets + next_run * BLOCK_W)
        # int4: the next run's group scales and x's codes are requested with its words, so that their
        # latency is off the step's critical path (int8, with no scale in the loop, ran slower so).
        if INT4:
            s_next = tl.load(s_ptrs + next_rows[:, None].to(tl.int64) * stride_sn + next_run * BLOCK_B)
            x_even_next = tl.load(x_ptrs + next_run * 2 * BLOCK_W)
            x_odd_next = tl.load(x_ptrs + next_run * 2 * BLOCK_W + 16)
        rows = (pid + (i // RUNS) * programs) * BLOCK_N + tile_rows
        row_ok = rows < N
        rows = tl.minimum(rows, N - 1)
        run = i % RUNS
        if INT4:
            even = ((w << 4) & high_nibbles) ^ sign_bits  # codes 0, 2, 4, 6 as 16 · q a byte
            odd = (w & high_nibbles) ^ sign_bits  # codes 1, 3, 5, 7
            sums = _dp4a(odd, tl.broadcast_to(x_odd, (BLOCK_N, BLOCK_B, 16)),
                         _dp4a(even, tl.broadcast_to(x_even, (BLOCK_N, BLOCK_B, 16)), zero))
            acc += sums.to(tl.float32) * s.to(tl.float32)[:, :, None]
            s, x_even, x_odd = s_next, x_even_next, x_odd_next
        else:
            xw = tl.broadcast_to(tl.load(x_ptrs + run * BLOCK_W), (BLOCK_N, BLOCK_B, 16))
            acc = _dp4a(w ^ sign_bits, xw, acc)
        if run == RUNS - 1:
            if INT4:
                y = tl.sum(tl.sum(acc, axis=2), axis=1) * (x_scale * 0.0625)
                acc = tl.zeros((BLOCK_N, BLOCK_B, 16), dtype=tl.float32)
            else:
                y = tl.sum(tl.sum(acc, axis=2), axis=1).to(tl.float32) * tl.load(S + rows) * x_scale
                acc = zero
            if HAS_BIAS:
                y += tl.load(B + rows).to(tl.float32)
            if HAS_RESIDUAL:  # rounded first, as the add after the projection would see it
                y = y.to(Y.dtype.element_ty).to(tl.float32) + tl.load(R + rows).to(tl.float32)
            tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)
        w = w_next


# --------------------------------------------------------------------------------------------
# Host launcher
# --------------------------------------------------------------------------------------------

# The tiles (scripts/tune-quant-gemv --pdl --rows 1 over the Llama 3 1B and 8B projections, on an H200 and an
# H100): 4 rows of W, runs of up to 16 blocks (256 words, 2 warps), 8 programs an SM. Weights whose tiles outnumber
# those programs (the 8B q/k/v; gate/up and lm_head, A8_WIDE_ROWS rows or more, many times over) take 16 programs an
# SM: int4 with runs of 8 blocks at one warp; int8 with runs of 16 at two, 8 rows a tile where wide. int8 rows of
# A8_LONG_ROW_BLOCKS blocks or more (the down projections) take runs of 32 blocks at two warps.
A8_ROWS = 4
A8_MAX_RUN_BLOCKS = 16
A8_PROGRAMS_PER_SM = 8
A8_WIDE_ROWS = 16384
A8_LONG_ROW_BLOCKS = 128


@functools.lru_cache(maxsize=1024)
def gemv_a8_config(n: int, n_words: int, fmt: str, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_B, num_warps, programs per SM) for a weight of n rows of n_words words on a GPU of `sms`
    SMs: the longest run of blocks up to the cap (above) that divides the row (so that no run is masked)."""
    wide = n >= A8_WIDE_ROWS
    many_tiles = wide or cdiv(n, A8_ROWS) > A8_PROGRAMS_PER_SM * sms
    blocks = n_words // BLOCK_WORDS
    if fmt == "int4":
        cap = 8 if many_tiles else A8_MAX_RUN_BLOCKS
    elif wide:
        cap = 8
    elif blocks >= A8_LONG_ROW_BLOCKS and not many_tiles:
        cap = 2 * A8_MAX_RUN_BLOCKS
    else:
        cap = A8_MAX_RUN_BLOCKS
    block_b = 1
    while block_b < cap and blocks % (2 * block_b) == 0:
        block_b *= 2
    block_n = 8 if wide and fmt == "int8" else A8_ROWS
    num_warps = max(1, min(2, block_b // 8))
    return block_n, block_b, num_warps, 2 * A8_PROGRAMS_PER_SM if many_tiles else A8_PROGRAMS_PER_SM


def runs_a8(rows: int, weight: QuantizedWeight) -> bool:
    """Whether this kernel takes `rows` rows of x by `weight`: one row of an int8 (of up to A8_INT8_MAX_K inputs)
    or int4-g128 weight."""
    int8 = weight.fmt == "int8" and weight.in_features <= A8_INT8_MAX_K
    return rows == 1 and (int8 or (weight.fmt == "int4" and weight.group_size == A8_INT4_GROUP))


def launch_gemv_a8(x2: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, y2: torch.Tensor,
                   config: tuple[int, int, int, int] | None = None, residual: torch.Tensor | None = None,
                   norm: tuple[torch.Tensor, float] | None = None) -> None:
    """y2 [1, N] = quantize(x2) · Wᵀ (+ bias) (+ residual [1, N]), x2's one row rounded to int8 (with `norm` =
    (weight, eps), RMSNorm(x2)'s: quantize_rows); inputs checked by the caller (quantized_linear): x2 [1, K] with
    unit column stride, y2 and residual contiguous in x2's dtype.
    config: (BLOCK_N, BLOCK_B, num_warps, programs per SM), gemv_a8_config's by default."""
    if not runs_a8(x2.shape[0], weight):
        raise ValueError(f"launch_gemv_a8 takes one row and an int8 or int4-g{A8_INT4_GROUP} weight, got "
                         f"{x2.shape[0]} rows and {weight.fmt} (group {weight.group_size})")
    n, n_words = weight.out_features, weight.data.shape[1]
    int4 = weight.fmt == "int4"
    codes, x_scale = quantize_rows(x2, (8 if int4 else 4) * n_words, weight.fmt, norm)
    sms = sm_count(x2.device)
    block_n, block_b, num_warps, per_sm = config or gemv_a8_config(n, n_words, weight.fmt, sms)
    n_tiles = cdiv(n, block_n)
    pdl = use_pdl(x2.device)
    launch(_gemv_a8_kernel, (min(n_tiles, per_sm * sms),),
        codes.view(torch.int32), x_scale, weight.data, weight.scales, bias, residual, y2,
        n, n_words, weight.scales.stride(0), n_tiles, HIGH_NIBBLES, SIGN_BITS,
        INT4=int4, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, BLOCK_B=block_b,
        RUNS=n_words // (16 * block_b),
        USE_PDL=pdl, num_warps=num_warps, num_stages=1, launch_pdl=pdl,
    )
