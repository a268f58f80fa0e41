"""FlashAttention's forward in Triton: out = softmax(q·kᵀ·scale)·v and the row log-sum-exp.

Each program owns a block of query rows and streams the keys and values of its (batch, head) in
blocks, keeping a running row maximum and row sum (the online softmax, in the exp2 domain with
log2(e) folded into the scale) and an fp32 accumulator. Causal attention skips every key block
right of the diagonal and masks only the blocks on it. The row log-sum-exp is kept for the
backward pass (`flash_backward`), which recomputes the probabilities block by block instead of
storing them.

Grouped-query attention reads the key/value head of each query head in place (head h uses
kv head h // (heads / kv_heads)); nothing is repeated in memory. The same kernels serve packed
variable-length batches: `cu_seqlens` gives each sequence's first row.

On Hopper at head dim 128, padded calls whose lengths are whole 128-row blocks take a warp-specialized
forward written in Gluon instead (`flash_forward_hopper`); its log-sum-exp is this kernel's, so the
backward is shared.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.launch import cdiv, resident_programs, sm_count
from fuselab.kernels._common.optional import optional_gluon
from fuselab.kernels._common.validate import INTERPRETED
from fuselab.kernels.attention.common import (
    LOG2E,
    dot_precision,
    forward_config,
    load_tile,
    new_row_stats,
    padded_head_dim,
    row_strides,
    sequence_span,
    tile_dot,
    tma_forward_config,
)

# The Hopper forward, in Gluon; None on a Triton without it, where the kernels here take every call.
hopper = optional_gluon("fuselab.kernels.attention.flash_forward_hopper")

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

# Stages of the key loop: what each key block needs masked.
_FULL = tl.constexpr(0)  # every key is visible to every query row: no mask
_DIAGONAL = tl.constexpr(1)  # causal blocks on the diagonal: key <= query and key < seq_k
_TAIL = tl.constexpr(2)  # the last, partial key block of non-causal attention: key < seq_k


@triton.jit
def _program_tile(num_heads, m_blocks, whole_tiles, splits, CAUSAL: tl.constexpr, SPLIT: tl.constexpr):
    """(query block, batch · heads index, batch, head, part) of this program; part < 0: a whole tile.

    Grid (1-D): one program a (query block, batch · head) tile, a head's query blocks one after
    another. With SPLIT, that holds for the first `whole_tiles` tiles; `splits` programs follow for
    each remaining tile, each over a part of its keys (`tail_split`), `part` numbering them from 0.
    Causal programs differ in cost by their row, so each head's costliest (last) query blocks are
    launched first and the cheap ones fill the tail."""
    pid = tl.program_id(0)
    if SPLIT:
        part = pid - whole_tiles
        tile = tl.where(part >= 0, whole_tiles + part // splits, pid)
    else:
        part = -1
        tile = pid
    pid_m = tile % m_blocks
    if CAUSAL:
        pid_m = m_blocks - 1 - pid_m
    pid_bh = tile // m_blocks
    return pid_m, pid_bh, pid_bh // num_heads, pid_bh % num_heads, part


@triton.jit
def _key_range(part, splits, part_keys, seq_k, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """(lo, full_end, tail_start, hi): a non-causal program's keys [lo, hi), whole key blocks up to
    full_end, the partial last block from tail_start. All keys for a whole tile, else part
    `part % splits` of them (part_keys, a multiple of BLOCK_N, each)."""
    full_end = seq_k - seq_k % BLOCK_N
    if SPLIT:
        lo = tl.where(part >= 0, (part % splits) * part_keys, 0)
        hi = tl.where(part >= 0, tl.minimum(lo + part_keys, seq_k), seq_k)
        return lo, tl.minimum(full_end, hi), tl.maximum(full_end, lo), hi
    else:
        return 0, full_end, full_end, seq_k


@triton.jit
def _store_part(PART_OUT, PART_LSE, part, acc, l_i, m_i, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """A part's normalized output (fp32) and log-sum-exp, for `_merge_parts_kernel`: rows are the tile's
    own, out-of-sequence ones included (their queries are zeros, their results finite and never stored)."""
    rows = part.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(PART_LSE + rows, m_i + tl.math.log2(l_i))
    tl.store(PART_OUT + rows[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :], acc / l_i[:, None])


@triton.jit
def _softmax_step(qk, m_i, l_i, offs_m, keys, key_ok, qk_scale, STAGE: tl.constexpr):
    """One key block's scores into the online softmax: (p, rescale of the running sums, row sum, row max)."""
    # Every row sees at least one key in the first block it processes, so m_new is finite.
    if STAGE == _FULL:
        # Scale and shift in one multiply-add per score: the softmax, not the dots, bounds this loop.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]
    else:
        if STAGE == _DIAGONAL:
            keep = (offs_m[:, None] >= keys[None, :]) & key_ok[None, :]
        else:
            keep = key_ok[None, :]
        qk = tl.where(keep, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_new[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _attend_keys(
    acc, l_i, m_i, q, K_base, V_base, stride_ks, stride_vs, offs_m, offs_d, lo, hi, seq_k, qk_scale,
    STAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Folds key blocks [lo, hi) into the running (acc, row sum l_i, row max m_i) of one query block."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    CHECK_KEYS: tl.constexpr = STAGE != _FULL
    offs_n = tl.arange(0, BLOCK_N)
    # K is read transposed, [head_dim, keys], so q·kᵀ is a plain dot.
    kT_ptrs = K_base + offs_n[None, :] * stride_ks + offs_d[:, None]
    v_ptrs = V_base + offs_n[:, None] * stride_vs + offs_d[None, :]
    d_row = (offs_d < HEAD_DIM)[:, None]
    d_col = (offs_d < HEAD_DIM)[None, :]
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        keys = start_n + offs_n
        key_ok = keys < seq_k
        kT = load_tile(kT_ptrs + start_n * stride_ks, key_ok[None, :], d_row, CHECK_KEYS, PAD_D)
        qk = tile_dot(q, kT, None, DOT_PRECISION)
        p, alpha, l_i, m_new = _softmax_step(qk, m_i, l_i, offs_m, keys, key_ok, qk_scale, STAGE)
        v = load_tile(v_ptrs + start_n * stride_vs, key_ok[:, None], d_col, CHECK_KEYS, PAD_D)
        acc = tile_dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_keys_tma(
    acc, l_i, m_i, q, k_desc, v_desc, kv_bh, offs_m, lo, hi, seq_k, qk_scale,
    STAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """`_attend_keys` with K and V tiles loaded through TMA descriptors over [batch · kv_heads, seq,
    head_dim]: rows past seq_k arrive as zeros, and are masked like the pointer path's."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        keys = start_n + offs_n
        k = k_desc.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p, alpha, l_i, m_new = _softmax_step(qk, m_i, l_i, offs_m, keys, keys < seq_k, qk_scale, STAGE)
        v = v_desc.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_forward_tma_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE, PART_OUT, PART_LSE, stride_lb, stride_lh, num_heads, group_size,
    seq_q, seq_k, qk_scale, m_blocks, whole_tiles, splits, part_keys,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """`_flash_forward_kernel` for contiguous [batch, heads, seq, head_dim] tensors whose head dim is a
    power of two, every tile moved through a TMA descriptor over [batch · heads, seq, head_dim]."""
    pid_m, pid_bh, batch, head, part = _program_tile(num_heads, m_blocks, whole_tiles, splits, CAUSAL, SPLIT)
    kv_bh = batch * (num_heads // group_size) + head // group_size
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([pid_bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        acc, l_i, m_i = _attend_keys_tma(acc, l_i, m_i, q, k_desc, v_desc, kv_bh, offs_m, 0, start_m, seq_k, qk_scale,
                                         _FULL, HEAD_DIM, BLOCK_N, DOT_PRECISION)
        acc, l_i, m_i = _attend_keys_tma(acc, l_i, m_i, q, k_desc, v_desc, kv_bh, offs_m,
                                         start_m, tl.minimum(start_m + BLOCK_M, seq_k), seq_k, qk_scale,
                                         _DIAGONAL, HEAD_DIM, BLOCK_N, DOT_PRECISION)
    else:
        lo, full_end, tail_start, hi = _key_range(part, splits, part_keys, seq_k, BLOCK_N, SPLIT)
        acc, l_i, m_i = _attend_keys_tma(acc, l_i, m_i, q, k_desc, v_desc, kv_bh, offs_m, lo, full_end, seq_k,
                                         qk_scale, _FULL, HEAD_DIM, BLOCK_N, DOT_PRECISION)
        acc, l_i, m_i = _attend_keys_tma(acc, l_i, m_i, q, k_desc, v_desc, kv_bh, offs_m, tail_start,
                                         hi, seq_k, qk_scale, _TAIL, HEAD_DIM, BLOCK_N, DOT_PRECISION)

    is_part = False
    if SPLIT:
        is_part = part >= 0
    if is_part:
        _store_part(PART_OUT, PART_LSE, part, acc, l_i, m_i, BLOCK_M, HEAD_DIM)
    else:
        row_ok = offs_m < seq_q
        tl.store(LSE + batch.to(tl.int64) * stride_lb + head.to(tl.int64) * stride_lh + offs_m,
                 m_i + tl.math.log2(l_i), mask=row_ok)
        out = acc / l_i[:, None]
        # Rows past seq_q fall outside the descriptor's bounds: the store leaves them out.
        o_desc.store([pid_bh, start_m, 0], out.to(q.dtype).reshape(1, BLOCK_M, HEAD_DIM))


@triton.jit
def _flash_forward_kernel(
    Q, K, V, O, LSE, CU_SEQLENS, PART_OUT, PART_LSE,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    num_heads, group_size, seq_q, seq_k, qk_scale, m_blocks, whole_tiles, splits, part_keys,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m, _, batch, head, part = _program_tile(num_heads, m_blocks, whole_tiles, splits, CAUSAL, SPLIT)
    kv_head = head // group_size
    first_row, seq_q, seq_k = sequence_span(CU_SEQLENS, batch, seq_q, seq_k, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seq_q:
        return
    batch = batch.to(tl.int64)
    Q_base = Q + batch * stride_qb + head.to(tl.int64) * stride_qh + first_row * stride_qs
    K_base = K + batch * stride_kb + kv_head.to(tl.int64) * stride_kh + first_row * stride_ks
    V_base = V + batch * stride_vb + kv_head.to(tl.int64) * stride_vh + first_row * stride_vs
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_q
    q = load_tile(Q_base + offs_m[:, None] * stride_qs + offs_d[None, :], row_ok[:, None],
                  (offs_d < HEAD_DIM)[None, :], True, BLOCK_D != HEAD_DIM)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        # Keys left of this block's first row: all visible. Then the diagonal block, masked.
        acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, K_base, V_base, stride_ks, stride_vs, offs_m, offs_d,
                                     0, start_m, seq_k, qk_scale,
                                     _FULL, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION)
        acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, K_base, V_base, stride_ks, stride_vs, offs_m, offs_d,
                                     start_m, tl.minimum(start_m + BLOCK_M, seq_k), seq_k, qk_scale,
                                     _DIAGONAL, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION)
    else:
        # Whole key blocks unmasked, then the partial last one (of this program's part of the keys).
        lo, full_end, tail_start, hi = _key_range(part, splits, part_keys, seq_k, BLOCK_N, SPLIT)
        acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, K_base, V_base, stride_ks, stride_vs, offs_m, offs_d,
                                     lo, full_end, seq_k, qk_scale,
                                     _FULL, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION)
        acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, K_base, V_base, stride_ks, stride_vs, offs_m, offs_d,
                                     tail_start, hi, seq_k, qk_scale,
                                     _TAIL, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION)

    is_part = False
    if SPLIT:
        is_part = part >= 0
    if is_part:
        _store_part(PART_OUT, PART_LSE, part, acc, l_i, m_i, BLOCK_M, BLOCK_D)
    else:
        # The log-sum-exp in log2 units of the scaled scores: the backward recomputes p = exp2(s - lse).
        tl.store(LSE + batch * stride_lb + head.to(tl.int64) * stride_lh + first_row + offs_m,
                 m_i + tl.math.log2(l_i), mask=row_ok)
        out = acc / l_i[:, None]
        O_base = O + batch * stride_ob + head.to(tl.int64) * stride_oh + first_row * stride_os
        o_ptrs = O_base + offs_m[:, None] * stride_os + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _merge_parts_kernel(
    PART_OUT, PART_LSE, O, LSE, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    num_heads, m_blocks, whole_tiles, splits, seq_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
):
    """The output and log-sum-exp of each split tile from its parts: out = Σ w_p · out_p / Σ w_p with
    w_p = exp2(lse_p - max lse). Grid: (split tiles, BLOCK_M // ROWS), ROWS of a tile's rows a program."""
    split_tile = tl.program_id(0)
    tile_rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    weight = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for p in range(0, splits):
        # Non-causal parts each hold keys: every lse_p is finite, and the first rescale is exp2(-inf) = 0.
        rows = (split_tile * splits + p).to(tl.int64) * BLOCK_M + tile_rows
        lse = tl.load(PART_LSE + rows)
        out = tl.load(PART_OUT + rows[:, None] * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m, lse)
        old, new = tl.math.exp2(m - m_new), tl.math.exp2(lse - m_new)
        acc = acc * old[:, None] + out * new[:, None]
        weight = weight * old + new
        m = m_new
    tile = whole_tiles + split_tile
    pid_bh = tile // m_blocks
    batch, head = (pid_bh // num_heads).to(tl.int64), (pid_bh % num_heads).to(tl.int64)
    offs_m = (tile % m_blocks) * BLOCK_M + tile_rows
    row_ok = offs_m < seq_q
    tl.store(LSE + batch * stride_lb + head * stride_lh + offs_m, m + tl.math.log2(weight), mask=row_ok)
    o_ptrs = O + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, (acc / weight[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


# --------------------------------------------------------------------------------------------
# Host launcher
# --------------------------------------------------------------------------------------------

def _tma_layout(q, k, v, out, varlen: bool) -> bool:
    """Padded, contiguous, 16-byte aligned [batch, heads, seq, head_dim] bf16/fp16 tensors with a
    power-of-two head dim: what a TMA descriptor can describe, in the dtypes its tiles were sized for."""
    head_dim = q.shape[-1]
    return (not varlen and q.element_size() == 2 and head_dim == padded_head_dim(head_dim) and head_dim >= 8
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v, out)))


def tail_split(tiles: int, slots: int, key_blocks: int) -> tuple[int, int, int]:
    """(whole tiles, parts per remaining tile, key blocks per part) for `tiles` equal programs of
    `key_blocks` key blocks each, `slots` of which the GPU runs at once.

    Equal programs run in waves; a last wave of a few leaves the other SMs idle for a whole program's
    time (at 32k tokens x 16 heads, 4096 128-row tiles on 132 SMs are 32 waves for 31.03 of work).
    When the last wave is at most half full, its tiles are cut along the keys into parts that
    together fill it, and merged after."""
    rest = tiles % slots
    if tiles <= slots or rest == 0 or 2 * rest > slots:
        return tiles, 1, key_blocks
    parts = min(slots // rest, key_blocks)
    if parts < 2:
        return tiles, 1, key_blocks
    per_part = cdiv(key_blocks, parts)
    return tiles - rest, cdiv(key_blocks, per_part), per_part


_slots_cache: dict[tuple, int] = {}


def _slots(kernel, key: tuple, device: torch.device, *args, **kwargs) -> int:
    """How many programs of `kernel` (compiled for these arguments) the GPU runs at once; cached by `key`."""
    if key not in _slots_cache:
        if INTERPRETED:
            _slots_cache[key] = sm_count(device)
        else:
            _slots_cache[key] = resident_programs(kernel.warmup(*args, grid=(1,), **kwargs), device)
    return _slots_cache[key]


def flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for validated inputs; lse is in log2 units of the scaled scores.

    Padded inputs are [batch, heads, seq, head_dim]; with `cu_seqlens`, packed [tokens, heads, head_dim].
    """
    varlen = cu_seqlens is not None
    if not varlen and hopper is not None and hopper.supports(q, k, v, causal):
        return hopper.flash_forward_hopper(q, k, v, causal, scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse, (stride_lb, stride_lh) = new_row_stats(q, varlen)
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[-1]
    if varlen:
        # The grid covers max_seqlen rows a sequence; the kernel is given the token count instead, the
        # bound of every sequence's rows (`sequence_span`).
        batch, seq_q, seq_k = cu_seqlens.numel() - 1, max_seqlen, max_seqlen
        kernel_lengths = (q.shape[0], q.shape[0])
    else:
        batch, seq_q, seq_k = q.shape[0], q.shape[2], k.shape[2]
        kernel_lengths = (seq_q, seq_k)
    tma_cfg = tma_forward_config(head_dim, causal, seq_q)
    use_tma = tma_cfg is not None and _tma_layout(q, k, v, out, varlen)
    cfg = tma_cfg if use_tma else forward_config(head_dim)
    block_d = head_dim if use_tma else padded_head_dim(head_dim)
    m_blocks = cdiv(seq_q, cfg.block_m)
    tiles = m_blocks * batch * heads
    common = dict(HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
                  DOT_PRECISION=dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if use_tma:
        kernel = _flash_forward_tma_kernel

        def desc(t, rows):
            return TensorDescriptor.from_tensor(t.view(-1, t.shape[2], head_dim), [1, rows, head_dim])
        head_args = (desc(q, cfg.block_m), desc(k, cfg.block_n), desc(v, cfg.block_n), desc(out, cfg.block_m), lse)
        stride_args = (stride_lb, stride_lh)
    else:
        kernel = _flash_forward_kernel
        head_args = (q, k, v, out, lse, cu_seqlens if varlen else lse)
        stride_args = (*row_strides(q, varlen), *row_strides(k, varlen), *row_strides(v, varlen),
                       *row_strides(out, varlen), stride_lb, stride_lh)
        common.update(BLOCK_D=block_d, VARLEN=varlen)
    size_args = (heads, heads // kv_heads, *kernel_lengths, scale * LOG2E, m_blocks)

    # Causal tiles differ in cost (the costliest go first instead), packed sequences in length.
    whole, splits, part_blocks = tiles, 1, 0
    if not (causal or varlen):
        slots = _slots(kernel, (use_tma, head_dim, q.dtype, cfg, q.device), q.device,
                       *head_args, lse, lse, *stride_args, *size_args, tiles, 1, 0, SPLIT=False, **common)
        # Where programs share SMs, one left alone in the last wave runs faster than its share, and the
        # tail costs less than a program's time: at d=64 (two an SM) splitting gained nothing.
        if slots == sm_count(q.device):
            whole, splits, part_blocks = tail_split(tiles, slots, cdiv(seq_k, cfg.block_n))
    split_tiles = tiles - whole
    if split_tiles:
        part_out = torch.empty(split_tiles * splits * cfg.block_m, block_d, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(split_tiles * splits * cfg.block_m, device=q.device, dtype=torch.float32)
    else:
        part_out = part_lse = lse  # not written
    launch(kernel, (whole + split_tiles * splits,),
        *head_args, part_out, part_lse, *stride_args, *size_args, whole, splits, part_blocks * cfg.block_n,
        SPLIT=split_tiles > 0, **common,
    )
    if split_tiles:
        rows = min(cfg.block_m, _MERGE_ROWS)
        launch(_merge_parts_kernel, (split_tiles, cfg.block_m // rows),
            part_out, part_lse, out, lse, *row_strides(out, False), stride_lb, stride_lh,
            heads, m_blocks, whole, splits, seq_q,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=cfg.block_m, ROWS=rows, num_warps=4,
        )
    return out, lse


# Rows of a split tile one merge program combines.
_MERGE_ROWS = 32
