"""The FlashAttention backward pass: dq, dk, dv from dout and the forward's log-sum-exp.

Three launches. `delta = rowsum(dout · out)` first; then one program per key block computes dk
and dv, streaming the query blocks of every query head that shares its key/value head (so a
grouped-query head's gradient is summed in registers, with no atomics); then one program per
query block computes dq, streaming the key blocks. The probabilities are recomputed from the
saved log-sum-exp: p = exp2(q·kᵀ·scale·log2(e) - lse), ds = p · (dout·vᵀ - delta).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselab.kernels.attention.common import (
    LOG2E,
    backward_config,
    dot_precision,
    new_row_stats,
    padded_head_dim,
    row_strides,
    sequence_span,
    tile_dot,
)
from fuselab.kernels._common.launch import cdiv

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
# Rows past a sequence's end are loaded as zeros (q, dout, k, v, lse, delta alike); the algebra
# then makes their contribution exactly zero, so only the causal mask needs a `where`.


@triton.jit
def _delta_kernel(
    O, DO, DELTA, CU_SEQLENS, stride_ob, stride_oh, stride_os, stride_db, stride_dh, stride_dos, stride_lb, stride_lh,
    num_heads, seq_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    batch = tl.program_id(1) // num_heads
    head = (tl.program_id(1) % num_heads).to(tl.int64)
    first_row, seq_q, _ = sequence_span(CU_SEQLENS, batch, seq_q, seq_q, VARLEN)
    batch = batch.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < seq_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = first_row + offs_m
    o = tl.load(O + batch * stride_ob + head * stride_oh + rows[:, None] * stride_os + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + batch * stride_db + head * stride_dh + rows[:, None] * stride_dos + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + batch * stride_lb + head * stride_lh + rows, delta, mask=offs_m < seq_q)


@triton.jit
def _dkdv_over_queries(
    dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, stride_qs, stride_dos, offs_n, offs_d, lo, hi, seq_q,
    qk_scale, CAUSAL_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Adds the query rows [lo, hi) of one head to the dk, dv of one key block (k, v: [BLOCK_N, D])."""
    offs_m = tl.arange(0, BLOCK_M)
    qT_ptrs = Q_base + offs_m[None, :] * stride_qs + offs_d[:, None]
    do_ptrs = DO_base + offs_m[:, None] * stride_dos + offs_d[None, :]
    d_ok = offs_d < HEAD_DIM
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        rows = start_m + offs_m
        row_ok = rows < seq_q
        qT = tl.load(qT_ptrs + start_m * stride_qs, mask=d_ok[:, None] & row_ok[None, :], other=0.0)
        lse = tl.load(LSE_base + rows, mask=row_ok, other=0.0)
        pT = tl.math.exp2(tile_dot(k, qT, None, DOT_PRECISION) * qk_scale - lse[None, :])
        if CAUSAL_MASK:
            pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)
        do = tl.load(do_ptrs + start_m * stride_dos, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        dv = tile_dot(pT.to(do.dtype), do, dv, DOT_PRECISION)
        delta = tl.load(DELTA_base + rows, mask=row_ok, other=0.0)
        dpT = tile_dot(v, tl.trans(do), None, DOT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tile_dot(dsT.to(qT.dtype), tl.trans(qT), dk, DOT_PRECISION)
    return dk, dv


@triton.jit
def _flash_backward_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, CU_SEQLENS,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    stride_lb, stride_lh, num_kv_heads, group_size, seq_q, seq_k, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Grid: (key blocks, batch · kv_heads).
    start_n = tl.program_id(0) * BLOCK_N
    batch = tl.program_id(1) // num_kv_heads
    kv_head = tl.program_id(1) % num_kv_heads
    first_row, seq_q, seq_k = sequence_span(CU_SEQLENS, batch, seq_q, seq_k, VARLEN)
    if start_n >= seq_k:
        return
    batch = batch.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n < seq_k)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows_k = first_row + offs_n
    K_base = K + batch * stride_kb + kv_head.to(tl.int64) * stride_kh
    V_base = V + batch * stride_vb + kv_head.to(tl.int64) * stride_vh
    k = tl.load(K_base + rows_k[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V_base + rows_k[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(0, group_size):
        head = (kv_head * group_size + g).to(tl.int64)
        Q_base = Q + batch * stride_qb + head * stride_qh + first_row * stride_qs
        DO_base = DO + batch * stride_dob + head * stride_doh + first_row * stride_dos
        LSE_base = LSE + batch * stride_lb + head * stride_lh + first_row
        DELTA_base = DELTA + batch * stride_lb + head * stride_lh + first_row
        if CAUSAL:
            # Only rows at or below the key block see it; the rows beside it need the mask.
            diagonal_end = tl.minimum(start_n + BLOCK_N, seq_q)
            dk, dv = _dkdv_over_queries(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, stride_qs, stride_dos,
                                        offs_n, offs_d, start_n, diagonal_end, seq_q, qk_scale,
                                        True, HEAD_DIM, BLOCK_M, DOT_PRECISION)
            dk, dv = _dkdv_over_queries(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, stride_qs, stride_dos,
                                        offs_n, offs_d, start_n + BLOCK_N, seq_q, seq_q, qk_scale,
                                        False, HEAD_DIM, BLOCK_M, DOT_PRECISION)
        else:
            dk, dv = _dkdv_over_queries(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, stride_qs, stride_dos,
                                        offs_n, offs_d, 0, seq_q, seq_q, qk_scale,
                                        False, HEAD_DIM, BLOCK_M, DOT_PRECISION)
    DK_base = DK + batch * stride_dkb + kv_head.to(tl.int64) * stride_dkh
    DV_base = DV + batch * stride_dvb + kv_head.to(tl.int64) * stride_dvh
    tl.store(DK_base + rows_k[:, None] * stride_dks + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV_base + rows_k[:, None] * stride_dvs + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_over_keys(
    dq, q, do, lse, delta, K_base, V_base, stride_ks, stride_vs, offs_m, offs_d, lo, hi, seq_k, qk_scale,
    CAUSAL_MASK: tl.constexpr, KEY_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Adds the key blocks [lo, hi) to dq of one query block (q, do: [BLOCK_M, D]).

    Keys past the end load as zeros but their p = exp2(-lse) is not zero and may overflow, so the
    partial last block (KEY_MASK) drops them explicitly.
    """
    offs_n = tl.arange(0, BLOCK_N)
    kT_ptrs = K_base + offs_n[None, :] * stride_ks + offs_d[:, None]
    vT_ptrs = V_base + offs_n[None, :] * stride_vs + offs_d[:, None]
    d_ok = (offs_d < HEAD_DIM)[:, None]
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        keys = start_n + offs_n
        mask = d_ok & (keys < seq_k)[None, :]
        kT = tl.load(kT_ptrs + start_n * stride_ks, mask=mask, other=0.0)
        p = tl.math.exp2(tile_dot(q, kT, None, DOT_PRECISION) * qk_scale - lse[:, None])
        if CAUSAL_MASK:
            p = tl.where(offs_m[:, None] >= keys[None, :], p, 0.0)
        if KEY_MASK:
            p = tl.where((keys < seq_k)[None, :], p, 0.0)
        vT = tl.load(vT_ptrs + start_n * stride_vs, mask=mask, other=0.0)
        dp = tile_dot(do, vT, None, DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tile_dot(ds.to(kT.dtype), tl.trans(kT), dq, DOT_PRECISION)
    return dq


@triton.jit
def _flash_backward_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, CU_SEQLENS,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_dob, stride_doh, stride_dos, stride_dqb, stride_dqh, stride_dqs,
    stride_lb, stride_lh, num_heads, group_size, seq_q, seq_k, scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Grid: (query blocks, batch · heads).
    start_m = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1) // num_heads
    head = tl.program_id(1) % num_heads
    kv_head = (head // group_size).to(tl.int64)
    head = head.to(tl.int64)
    first_row, seq_q, seq_k = sequence_span(CU_SEQLENS, batch, seq_q, seq_k, VARLEN)
    if start_m >= seq_q:
        return
    batch = batch.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seq_q
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = first_row + offs_m
    q = tl.load(Q + batch * stride_qb + head * stride_qh + rows[:, None] * stride_qs + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + batch * stride_dob + head * stride_doh + rows[:, None] * stride_dos + offs_d[None, :],
                 mask=mask, other=0.0)
    lse = tl.load(LSE + batch * stride_lb + head * stride_lh + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + batch * stride_lb + head * stride_lh + rows, mask=row_ok, other=0.0)
    K_base = K + batch * stride_kb + kv_head * stride_kh + first_row * stride_ks
    V_base = V + batch * stride_vb + kv_head * stride_vh + first_row * stride_vs
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        dq = _dq_over_keys(dq, q, do, lse, delta, K_base, V_base, stride_ks, stride_vs, offs_m, offs_d,
                           0, start_m, seq_k, qk_scale, False, False, HEAD_DIM, BLOCK_N, DOT_PRECISION)
        # Valid rows see keys <= row < seq_k on the diagonal: the causal mask bounds them too.
        dq = _dq_over_keys(dq, q, do, lse, delta, K_base, V_base, stride_ks, stride_vs, offs_m, offs_d,
                           start_m, tl.minimum(start_m + BLOCK_M, seq_k), seq_k, qk_scale,
                           True, False, HEAD_DIM, BLOCK_N, DOT_PRECISION)
    else:
        full_end = seq_k - seq_k % BLOCK_N
        dq = _dq_over_keys(dq, q, do, lse, delta, K_base, V_base, stride_ks, stride_vs, offs_m, offs_d,
                           0, full_end, seq_k, qk_scale, False, False, HEAD_DIM, BLOCK_N, DOT_PRECISION)
        dq = _dq_over_keys(dq, q, do, lse, delta, K_base, V_base, stride_ks, stride_vs, offs_m, offs_d,
                           full_end, seq_k, seq_k, qk_scale, False, True, HEAD_DIM, BLOCK_N, DOT_PRECISION)
    tl.store(DQ + batch * stride_dqb + head * stride_dqh + rows[:, None] * stride_dqs + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host launcher
# --------------------------------------------------------------------------------------------


def flash_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the shapes of q, k, v; `lse` is the forward's, in log2 units."""
    varlen = cu_seqlens is not None
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    delta, (stride_lb, stride_lh) = new_row_stats(q, varlen)
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[-1]
    if varlen:
        # Grids cover max_seqlen rows a sequence; kernels are given the token count, the bound of every
        # sequence's rows (`sequence_span`).
        batch, seq_q, seq_k = cu_seqlens.numel() - 1, max_seqlen, max_seqlen
        len_q = len_k = q.shape[0]
    else:
        batch, seq_q, seq_k = q.shape[0], q.shape[2], k.shape[2]
        len_q, len_k = seq_q, seq_k
    cu = cu_seqlens if varlen else lse  # never read unless VARLEN
    cfg = backward_config(head_dim)
    shape = dict(HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim), VARLEN=varlen)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    qk_scale = scale * LOG2E
    q_strides, do_strides = row_strides(q, varlen), row_strides(dout, varlen)
    kv_strides = (*row_strides(k, varlen), *row_strides(v, varlen))

    _delta_kernel[(cdiv(seq_q, cfg.block_m2), batch * heads)](
        out, dout, delta, cu, *row_strides(out, varlen), *do_strides, stride_lb, stride_lh, heads, len_q,
        BLOCK_M=cfg.block_m2, **shape,
    )
    _flash_backward_dkdv_kernel[(cdiv(seq_k, cfg.block_n1), batch * kv_heads)](
        q, k, v, dout, dk, dv, lse, delta, cu, *q_strides, *kv_strides, *do_strides,
        *row_strides(dk, varlen), *row_strides(dv, varlen), stride_lb, stride_lh,
        kv_heads, heads // kv_heads, len_q, len_k, scale, qk_scale,
        BLOCK_M=cfg.block_m1, BLOCK_N=cfg.block_n1, CAUSAL=causal, DOT_PRECISION=dot_precision(q.dtype),
        **shape, **launch,
    )
    _flash_backward_dq_kernel[(cdiv(seq_q, cfg.block_m2), batch * heads)](
        q, k, v, dout, dq, lse, delta, cu, *q_strides, *kv_strides, *do_strides, *row_strides(dq, varlen),
        stride_lb, stride_lh, heads, heads // kv_heads, len_q, len_k, scale, qk_scale,
        BLOCK_M=cfg.block_m2, BLOCK_N=cfg.block_n2, CAUSAL=causal, DOT_PRECISION=dot_precision(q.dtype),
        **shape, **launch,
    )
    return dq, dk, dv
