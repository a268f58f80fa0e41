"""FlashAttention's forward for Hopper (sm_90), written in Gluon, Triton's lower-level dialect, where
warps, shared-memory buffers and barriers are explicit.

Why a second forward kernel: the Triton kernel's two warpgroups run in lockstep, both at the tensor
cores, then both at the softmax, so the tensor cores idle while the exponentials are computed. Here a
program (128 query rows of one head) is three partitions:
- a load warp streams the K and V blocks through TMA into a ring of shared-memory stages, with barriers
  a stage saying "K arrived", "V arrived" and "free again";
- two compute warpgroups own 64 rows each and take turns issuing their matrix products (a pair of
  barriers passes the turn), so one's softmax overlaps the other's products. Each issues a block's q·kᵀ
  together with the previous block's p·v and waits for both once.
At head dim 128 it was faster than the Triton kernel on an H200 (docs/tuning/flash_attention-constants.md).

It takes what it was built and measured for: padded, contiguous bf16/fp16 [batch, heads, seq, 128]
tensors with both sequence lengths multiples of 128 (equal when causal), on a Hopper GPU, with the
Gluon of Triton 3.6; everything else goes to the Triton kernels. The log-sum-exp it leaves is the
Triton forward's (log2 units of the scaled scores), so the backward is shared.
"""

from __future__ import annotations

import inspect

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fuselab.kernels.attention.common import LOG2E
from fuselab.kernels._common.validate import INTERPRETED

# Query rows a program owns (two compute warpgroups of 64), keys a K/V block holds, ring stages: three
# 128x128 K and V stages and q fill 224 KB of the 227 KB an SM has (two were slower).
_ROWS = 128
_KEYS = 128
_STAGES = 3
_HEAD_DIM = 128
# Registers a thread of each partition asks for (setmaxnreg): the load warp gives its share to the
# compute warpgroups.
_COMPUTE_REGS = 232
_LOAD_REGS = 24

# --------------------------------------------------------------------------------------------
# Gluon kernel
# --------------------------------------------------------------------------------------------


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free,
                    q_row, kv_row, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One warp: q's two halves once, then K and V block by block into the ring, each stage reused once
    both compute warpgroups have freed it."""
    HALF: gl.constexpr = q_smem.shape[1]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + HALF, 0], q_bar, q_smem.index(1))
    for j in range(n_blocks):
        s = j % STAGES
        # A fresh barrier counts the phase before its first as complete: the first pass over the ring
        # does not wait.
        mbarrier.wait(kv_free.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _softmax_block(scores, m_i, l_i, acc, j, n_blocks, row0, qk_scale,
                   s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                   BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, dtype: gl.constexpr):
    """Block j's scores into the online softmax: (p as the next product's register operand, row max,
    row sum, acc rescaled). Causal: only the last block (the diagonal) has keys past some row."""
    HALF: gl.constexpr = scores.shape[0]
    if CAUSAL:
        rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
        keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = (rows[:, None] >= keys[None, :]) | (j < n_blocks - 1)
        qk = gl.where(keep, scores * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, axis=1))
        qk = qk - m_new[:, None]
    else:
        m_new = gl.maximum(m_i, gl.max(scores, axis=1) * qk_scale)
        qk = scores * qk_scale - m_new[:, None]
    p = gl.exp2(qk)
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    return gl.convert_layout(p.to(dtype), p_layout), m_new, l_i, acc


@gluon.jit
def _compute_partition(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, turn, o_desc, LSE,
                       lse_row, q_row, row0, n_blocks, qk_scale,
                       H: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr):
    """Warpgroup H's 64 rows: per key block, wait for its turn, issue q·kᵀ of this block and p·v of the
    last, pass the turn, wait for both products, free the last block's stage, then the softmax."""
    dtype: gl.constexpr = q_smem.dtype
    HALF: gl.constexpr = q_smem.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([HALF], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([HALF], gl.float32, layout=row_layout)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout)
    no_scores = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.index(H)
    mbarrier.wait(q_bar, 0)

    mbarrier.wait(k_ready.index(0), 0)
    mbarrier.wait(turn.index(H), 0)
    s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), no_scores, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(1 - H), count=1)
    scores = warpgroup_mma_wait(0, deps=(s_tok,))
    p, m_i, l_i, acc = _softmax_block(scores, m_i, l_i, acc, 0, n_blocks, row0, qk_scale,
                                      s_layout, o_layout, p_layout, BLOCK_N, CAUSAL, dtype)
    for j in range(1, n_blocks):
        s = j % STAGES
        last = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(last), ((j - 1) // STAGES) & 1)
        mbarrier.wait(turn.index(H), j & 1)
        s_tok = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), no_scores, use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - H), count=1)
        scores, acc = warpgroup_mma_wait(0, deps=(s_tok, acc_tok))
        mbarrier.arrive(kv_free.index(last), count=1)
        p, m_i, l_i, acc = _softmax_block(scores, m_i, l_i, acc, j, n_blocks, row0, qk_scale,
                                          s_layout, o_layout, p_layout, BLOCK_N, CAUSAL, dtype)
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    acc_tok = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc_tok,))
    mbarrier.arrive(kv_free.index(last), count=1)

    gl.store(LSE + lse_row + gl.arange(0, HALF, layout=row_layout), m_i + gl.log2(l_i))
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    # q's half of shared memory is free once its last q·kᵀ has completed: the output leaves through it.
    q.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q)
    tma.store_wait(0)


@gluon.jit
def _flash_forward_hopper_kernel(q_desc, k_desc, v_desc, o_desc, LSE, num_heads, group_size, seq_q, seq_k,
                                 qk_scale, m_blocks,
                                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                                 STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                                 COMPUTE_REGS: gl.constexpr, LOAD_REGS: gl.constexpr):
    """Grid (1-D): one program a (query block, batch · head), a head's blocks one after another; causal:
    the costliest (last) blocks first. Tensors are [rows, head_dim] views of [batch, heads, seq, d]."""
    tile = gl.program_id(0)
    pid_m = tile % m_blocks
    if CAUSAL:
        pid_m = m_blocks - 1 - pid_m
    pid_bh = tile // m_blocks
    batch = pid_bh // num_heads
    head = pid_bh % num_heads
    kv_bh = batch * (num_heads // group_size) + head // group_size
    start_m = pid_m * BLOCK_M
    q_row = pid_bh * seq_q + start_m
    if CAUSAL:
        n_blocks = gl.cdiv(start_m + BLOCK_M, BLOCK_N)
    else:
        n_blocks = gl.cdiv(seq_k, BLOCK_N)

    dtype: gl.constexpr = q_desc.dtype
    HALF: gl.constexpr = BLOCK_M // 2
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_free.index(s), count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    fence_async_shared()
    mbarrier.arrive(turn.index(0), count=1)  # warpgroup 0 goes first

    lse_row = pid_bh.to(gl.int64) * seq_q + start_m
    gl.warp_specialize([
        (_compute_partition, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, turn, o_desc, LSE,
                              lse_row, q_row, start_m, n_blocks, qk_scale, 0, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
        (_compute_partition, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, turn, o_desc, LSE,
                              lse_row + HALF, q_row + HALF, start_m + HALF, n_blocks, qk_scale, 1, BLOCK_N,
                              HEAD_DIM, STAGES, CAUSAL)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free,
                           q_row, kv_bh * seq_k, n_blocks, BLOCK_N, STAGES)),
    ], [4, 1], [COMPUTE_REGS, LOAD_REGS])


# --------------------------------------------------------------------------------------------
# Host launcher
# --------------------------------------------------------------------------------------------


def _gluon_api_matches() -> bool:
    # Gluon is experimental: its warp_specialize took this form in Triton 3.6 and changes across releases.
    warp_specialize = getattr(gl, "warp_specialize", None)
    return warp_specialize is not None and "functions_and_args" in inspect.signature(warp_specialize).parameters


_API_MATCHES = _gluon_api_matches()


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """Whether this kernel takes the (validated, padded-layout) call."""
    if INTERPRETED or not _API_MATCHES or q.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    return layout_fits(q, k, v, causal)


def layout_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """The shapes, dtypes and layouts the kernel was built for (any device)."""
    seq_q, seq_k = q.shape[2], k.shape[2]
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == _HEAD_DIM
            and seq_q > 0 and seq_q % _ROWS == 0 and seq_k % _KEYS == 0 and (seq_q == seq_k or not causal)
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v)))


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    flat = t.view(-1, t.shape[-1])
    dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([rows, t.shape[-1]], dtype)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, t.shape[-1]], layout)


def flash_forward_hopper(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse [batch, heads, seq] in log2 units of the scaled scores) for a call `supports` takes."""
    batch, heads, seq_q, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq_q, device=q.device, dtype=torch.float32)
    m_blocks = seq_q // _ROWS
    half = _ROWS // 2
    _flash_forward_hopper_kernel[(m_blocks * batch * heads,)](
        _descriptor(q, half), _descriptor(k, _KEYS), _descriptor(v, _KEYS), _descriptor(out, half), lse,
        heads, heads // k.shape[1], seq_q, k.shape[2], scale * LOG2E, m_blocks,
        BLOCK_M=_ROWS, BLOCK_N=_KEYS, HEAD_DIM=_HEAD_DIM, STAGES=_STAGES, CAUSAL=causal,
        COMPUTE_REGS=_COMPUTE_REGS, LOAD_REGS=_LOAD_REGS, num_warps=4,
    )
    return out, lse
