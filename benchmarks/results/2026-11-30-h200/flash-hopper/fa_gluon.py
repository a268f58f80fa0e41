"""Flash forward for Hopper in Gluon: a loader warp streams K/V through TMA into a ring of shared-memory
stages; two consumer warpgroups each own 64 of a program's 128 query rows and take turns at the tensor
cores (one's softmax runs while the other's matrix products do), each issuing this block's q·kᵀ together
with the previous block's p·v."""
import sys

import torch
import triton
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

HALF = 64
# Registers a thread of the second compute warpgroup may use (the first keeps the launch's count).
REGS_CONSUMER = gl.constexpr(232)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                    q_row, kv_row, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    HALF: gl.constexpr = q_smem.shape[1]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + HALF, 0], q_bar, q_smem.index(1))
    for j in range(n_blocks):
        s = j % STAGES
        # A fresh barrier counts its phase before 0 as complete: the first STAGES waits pass at once.
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _softmax(s_acc, m_i, l_i, acc, j, n_blocks, row0, qk_scale,
             s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
             BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, dtype: gl.constexpr):
    HALF: gl.constexpr = s_acc.shape[0]
    if CAUSAL:
        rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
        keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = (rows[:, None] >= keys[None, :]) | (j < n_blocks - 1)
        qk = gl.where(keep, s_acc * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, axis=1))
        qk = qk - m_new[:, None]
    else:
        m_new = gl.maximum(m_i, gl.max(s_acc, axis=1) * qk_scale)
        qk = s_acc * qk_scale - m_new[:, None]
    p = gl.exp2(qk)
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p = gl.convert_layout(p.to(dtype), p_layout)
    return p, m_new, l_i, acc


@gluon.jit
def _compute_partition(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, o_desc, LSE,
                       lse_row, q_row, row0, n_blocks, qk_scale,
                       H: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    HALF: gl.constexpr = q_smem.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m_i = gl.full([HALF], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([HALF], gl.float32, layout=row_layout)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, layout=o_layout)
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_layout)
    q = q_smem.index(H)
    mbarrier.wait(q_bar, 0)

    # Block 0: q·kᵀ alone.
    mbarrier.wait(k_ready.index(0), 0)
    mbarrier.wait(turn.index(H), 0)
    s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(1 - H), count=1)
    s_acc = warpgroup_mma_wait(0, deps=(s_tok,))
    p, m_i, l_i, acc = _softmax(s_acc, m_i, l_i, acc, 0, n_blocks, row0, qk_scale, s_layout, o_layout, p_layout,
                                BLOCK_N, CAUSAL, dtype)
    for j in range(1, n_blocks):
        s = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        mbarrier.wait(turn.index(H), j & 1)
        s_tok = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        mbarrier.arrive(turn.index(1 - H), count=1)
        s_acc, acc = warpgroup_mma_wait(0, deps=(s_tok, acc_tok))
        mbarrier.arrive(kv_empty.index(prev), count=1)
        p, m_i, l_i, acc = _softmax(s_acc, m_i, l_i, acc, j, n_blocks, row0, qk_scale, s_layout, o_layout,
                                    p_layout, BLOCK_N, CAUSAL, dtype)
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    acc_tok = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc_tok,))
    mbarrier.arrive(kv_empty.index(last), count=1)

    rows = gl.arange(0, HALF, layout=row_layout)
    gl.store(LSE + lse_row + rows, m_i + gl.log2(l_i))
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    # q's half of shared memory is free once its last q·kᵀ has completed: the output goes out through it.
    q.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q)
    tma.store_wait(0)


@gluon.jit
def _flash_forward_gluon(q_desc, k_desc, v_desc, o_desc, LSE, num_heads, group_size, seq_q, seq_k, qk_scale, m_blocks,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                         CAUSAL: gl.constexpr):
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
    kv_row = kv_bh * seq_k
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
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    fence_async_shared()
    # Warpgroup 0 goes first.
    mbarrier.arrive(turn.index(0), count=1)

    lse_row = pid_bh.to(gl.int64) * seq_q + start_m
    gl.warp_specialize([
        (_compute_partition, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, o_desc, LSE,
                              lse_row, q_row, start_m, n_blocks, qk_scale, 0, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
        (_compute_partition, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, o_desc, LSE,
                              lse_row + HALF, q_row + HALF, start_m + HALF, n_blocks, qk_scale, 1, BLOCK_N, HEAD_DIM,
                              STAGES, CAUSAL)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                           q_row, kv_row, n_blocks, BLOCK_N, STAGES)),
    ], [4, 1], [REGS_CONSUMER, 24])



def descriptors(q, k, v, out, block_n):
    d = q.shape[-1]
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([HALF, d], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gdt)

    def desc(t, rows, layout):
        flat = t.view(-1, d)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, d], layout)
    return desc(q, HALF, q_layout), desc(k, block_n, kv_layout), desc(v, block_n, kv_layout), desc(out, HALF, q_layout)


def flash_gluon(q, k, v, causal, block_n=128, stages=2):
    batch, heads, seq, d = q.shape
    assert seq % 128 == 0 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq, device=q.device, dtype=torch.float32)
    m_blocks = seq // 128
    _flash_forward_gluon[(m_blocks * batch * heads,)](
        *descriptors(q, k, v, out, block_n), lse, heads, heads // k.shape[1], seq, k.shape[2],
        d ** -0.5 * 1.4426950408889634, m_blocks,
        BLOCK_M=128, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, CAUSAL=causal, num_warps=4)
    return out, lse


def _tflops(b, h, s, d, causal, us):
    return 4 * b * h * s * s * d * (0.5 if causal else 1.0) / us / 1e6


def main():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fuselab.kernels import flash_attention
    from fuselab.timing import bench

    torch.manual_seed(0)
    for (b, h, hk, s) in ((1, 2, 2, 256), (2, 4, 1, 384)):
        q = torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hk, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for causal in (False, True):
            for stages in (2, 3):
                out, lse = flash_gluon(q, k, v, causal, stages=stages)
                torch.cuda.synchronize()
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q.float(), k.float().repeat_interleave(h // hk, 1), v.float().repeat_interleave(h // hk, 1),
                    is_causal=causal)
                print(f"check b{b} h{h}/{hk} s{s} causal={causal} stages={stages}: max err "
                      f"{(out.float() - ref).abs().max().item():.2e}", flush=True)
    heads, d = 16, 128
    for seq in [int(a) for a in sys.argv[1:]] or [4096, 16384]:
        batch = 32768 // seq
        q, k, v = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            ref = flash_attention(q, k, v, causal=causal)
            res = {}
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res["cudnn"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)).median_us
            res["main"] = bench(lambda: flash_attention(q, k, v, causal=causal)).median_us
            for stages in (2, 3):
                out, _ = flash_gluon(q, k, v, causal, stages=stages)
                err = (out.float() - ref.float()).abs().max().item()
                res[f"gluon stages {stages} (err {err:.1e})"] = bench(lambda: flash_gluon(q, k, v, causal, stages=stages)).median_us
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res["cudnn again"] = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)).median_us
            res["main again"] = bench(lambda: flash_attention(q, k, v, causal=causal)).median_us
            cud = min(res["cudnn"], res["cudnn again"])
            for name, us in res.items():
                print(f"S{seq} causal={causal} {name:36s} {us:8.1f} us {_tflops(batch, heads, seq, d, causal, us):6.1f} "
                      f"TFLOP/s {cud / us:.3f}x cudnn", flush=True)


if __name__ == "__main__":
    main()
