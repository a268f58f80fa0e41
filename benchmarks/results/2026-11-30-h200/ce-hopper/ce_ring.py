"""Loss + gradient with every chunk of the two walks streamed through a ring of shared-memory slots by TMA,
STAGES chunks ahead of the warps that fold / differentiate them (the gradient's walk re-reads from L2)."""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _issue(desc, ring, ready, k, n_steps, pid, programs, n_chunks, segs_per_row,
           R: gl.constexpr, STAGES: gl.constexpr):
    """Step k's chunk into slot k % STAGES: row pid + (k // 2C) · programs, chunk j (first walk) or 2C-1-j."""
    two_c = 2 * n_chunks
    j = k % two_c
    c = gl.where(j < n_chunks, j, two_c - 1 - j)
    row = pid + (k // two_c) * programs
    s = k % STAGES
    ok = k < n_steps
    mbarrier.expect(ready.index(s), desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(desc, [row * segs_per_row + c * R, 0], ready.index(s), ring.index(s), pred=ok)


@gluon.jit
def ce_ring_kernel(desc, logits_ptr, stride, target_ptr, row_loss_ptr, grad_ptr, gstride, n_rows, n_vocab, scale,
                   CHUNK: gl.constexpr, W: gl.constexpr, STAGES: gl.constexpr, LANE: gl.constexpr,
                   TARGET_AFTER: gl.constexpr, num_warps: gl.constexpr):
    R: gl.constexpr = CHUNK // W
    dtype: gl.constexpr = desc.dtype
    ring = gl.allocate_shared_memory(dtype, [STAGES, R, W], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
    fence_async_shared()

    layout: gl.constexpr = gl.BlockedLayout([1, LANE], [32, 1], [num_warps, 1], [1, 0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    lane_layout: gl.constexpr = gl.SliceLayout(1, layout)
    offs = gl.arange(0, CHUNK // LANE, layout=lane_layout)[:, None] * LANE + \
        gl.arange(0, LANE, layout=gl.SliceLayout(0, layout))[None, :]
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n_chunks = gl.cdiv(n_vocab, CHUNK)
    my_rows = gl.cdiv(gl.maximum(n_rows - pid, 0), programs)
    n_steps = my_rows * 2 * n_chunks
    segs_per_row = n_vocab // W
    for first in gl.static_range(STAGES):
        _issue(desc, ring, ready, first, n_steps, pid, programs, n_chunks, segs_per_row, R, STAGES)
    log2_scale = gl.log2(scale)
    k2: gl.constexpr = 1.4426950408889634

    for row_i in range(my_rows):
        row = (pid + row_i * programs).to(gl.int64)
        target = gl.load(target_ptr + row).to(gl.int64)
        in_vocab = (target >= 0) & (target < n_vocab)
        x_t = gl.load(logits_ptr + row * stride + gl.where(in_vocab, target, 0)).to(gl.float32)
        x_t = gl.where(in_vocab, x_t, float("nan"))
        lane_m = gl.full([CHUNK // LANE], float("-inf"), gl.float32, layout=lane_layout)
        lane_s = gl.zeros([CHUNK // LANE], gl.float32, layout=lane_layout)
        base = row_i * 2 * n_chunks
        for c in range(n_chunks):
            k = base + c
            s = k % STAGES
            mbarrier.wait(ready.index(s), (k // STAGES) & 1)
            x = ring.index(s)._reinterpret(dtype, [CHUNK // LANE, LANE], flat).load(layout)
            gl.thread_barrier()
            _issue(desc, ring, ready, k + STAGES, n_steps, pid, programs, n_chunks, segs_per_row, R, STAGES)
            cols = c * CHUNK + offs
            x = gl.where(cols < n_vocab, x.to(gl.float32), float("-inf"))
            new_m = gl.maximum(lane_m, gl.max(x, axis=1))
            shift = gl.where(new_m == float("-inf"), 0.0, new_m) * k2
            lane_s = lane_s * gl.exp2(lane_m * k2 - shift) + gl.sum(gl.exp2(x * k2 - shift[:, None]), axis=1)
            lane_m = new_m
        m = gl.max(lane_m, axis=0)
        shift = gl.where(m == float("-inf"), 0.0, m)
        lse = shift + gl.log(gl.sum(lane_s * gl.exp2((lane_m - shift) * k2), axis=0))
        gl.store(row_loss_ptr + row, lse - x_t)
        bias = lse * k2 - log2_scale
        grad_row = grad_ptr + row * gstride
        for i in range(n_chunks):
            c = n_chunks - 1 - i
            k = base + n_chunks + i
            s = k % STAGES
            mbarrier.wait(ready.index(s), (k // STAGES) & 1)
            x = ring.index(s)._reinterpret(dtype, [CHUNK // LANE, LANE], flat).load(layout)
            gl.thread_barrier()
            _issue(desc, ring, ready, k + STAGES, n_steps, pid, programs, n_chunks, segs_per_row, R, STAGES)
            cols = c * CHUNK + offs
            g = gl.exp2(x.to(gl.float32) * k2 - bias)
            if not TARGET_AFTER:
                g = gl.where(cols == target, g - scale, g)
            gl.store(grad_row + cols, g.to(dtype), mask=cols < n_vocab, cache_modifier=".cs")
        if TARGET_AFTER:
            gl.thread_barrier()
            gt = gl.exp2(x_t * k2 - bias) - scale
            gl.store(grad_row + target, gt.to(dtype), mask=in_vocab)
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(slot))


def seg_width(n_vocab: int, chunk: int) -> int:
    for w in (256, 128, 64, 32):
        if n_vocab % w == 0 and chunk // w <= 256:
            return w
    raise ValueError(f"vocab {n_vocab} not a multiple of 32")


def run(x, t, chunk, stages, warps, target_after=True):
    n_rows, n_vocab = x.shape
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    grad = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    w = seg_width(n_vocab, chunk)
    flat = x.view(-1, w)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [chunk // w, w], layout)
    ce_ring_kernel[(min(n_rows, sms),)](desc, x, x.stride(0), t, row_loss, grad, grad.stride(0), n_rows, n_vocab,
                                        1.0 / n_rows, CHUNK=chunk, W=w, STAGES=stages, LANE=8,
                                        TARGET_AFTER=target_after, num_warps=warps)
    return row_loss, grad


CONFIGS = [  # chunk, stages, warps, target after
    (8192, 12, 8, True),
    (8192, 12, 16, True),
    (8192, 13, 16, False),
    (4096, 24, 8, True),
    (4096, 24, 16, True),
    (8192, 8, 16, True),
    (16384, 6, 16, True),
    (4096, 16, 16, True),
]
