"""Loss + gradient: chunks stream by TMA through a ring of shared-memory slots (a load warp runs ahead);
the last KEEP chunks of a row's first walk stay in their slots for the gradient's walk, which starts
with them, so only the rest of the row is read a second time (from L2)."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _loads(desc, ring, ready, free, pid, programs, my_rows, n_chunks, keep, segs_per_row,
           R: gl.constexpr, STAGES: gl.constexpr):
    """Load warp: per row, chunks 0..C-1 (first walk), then C-keep-1..0 again (the gradient's re-reads)."""
    k = 0
    per_row = 2 * n_chunks - keep
    for row_i in range(my_rows):
        row = pid + row_i * programs
        for j in range(per_row):
            c = gl.where(j < n_chunks, j, 2 * n_chunks - keep - 1 - j)
            s = k % STAGES
            mbarrier.wait(free.index(s), ((k // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [row * segs_per_row + c * R, 0], ready.index(s), ring.index(s))
            k += 1


@gluon.jit
def _grad_chunk(ring, s, c, offs, bias, target, scale, grad_row, n_vocab,
                CHUNK: gl.constexpr, LANE: gl.constexpr, layout: gl.constexpr, TARGET_AFTER: gl.constexpr):
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    x = ring.index(s)._reinterpret(ring.dtype, [CHUNK // LANE, LANE], flat).load(layout)
    cols = c * CHUNK + offs
    g = gl.exp2(x.to(gl.float32) * 1.4426950408889634 - bias)
    if not TARGET_AFTER:
        g = gl.where(cols == target, g - scale, g)
    gl.store(grad_row + cols, g.to(ring.dtype), mask=cols < n_vocab, cache_modifier=".cs")


@gluon.jit
def _compute(ring, ready, free, logits_ptr, stride, target_ptr, row_loss_ptr, grad_ptr, gstride,
             pid, programs, my_rows, n_chunks, keep, n_vocab, scale,
             CHUNK: gl.constexpr, LANE: gl.constexpr, STAGES: gl.constexpr, TARGET_AFTER: gl.constexpr,
             num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, LANE], [32, 1], [num_warps, 1], [1, 0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    lane_layout: gl.constexpr = gl.SliceLayout(1, layout)
    offs = gl.arange(0, CHUNK // LANE, layout=lane_layout)[:, None] * LANE + \
        gl.arange(0, LANE, layout=gl.SliceLayout(0, layout))[None, :]
    k2: gl.constexpr = 1.4426950408889634
    log2_scale = gl.log2(scale)
    per_row = 2 * n_chunks - keep
    for row_i in range(my_rows):
        row = (pid + row_i * programs).to(gl.int64)
        target = gl.load(target_ptr + row).to(gl.int64)
        in_vocab = (target >= 0) & (target < n_vocab)
        x_t = gl.load(logits_ptr + row * stride + gl.where(in_vocab, target, 0)).to(gl.float32)
        x_t = gl.where(in_vocab, x_t, float("nan"))
        lane_m = gl.full([CHUNK // LANE], float("-inf"), gl.float32, layout=lane_layout)
        lane_s = gl.zeros([CHUNK // LANE], gl.float32, layout=lane_layout)
        base = row_i * per_row
        for c in range(n_chunks):
            k = base + c
            s = k % STAGES
            mbarrier.wait(ready.index(s), (k // STAGES) & 1)
            x = ring.index(s)._reinterpret(ring.dtype, [CHUNK // LANE, LANE], flat).load(layout)
            if c < n_chunks - keep:
                gl.thread_barrier()
                mbarrier.arrive(free.index(s), count=1)
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
        for i in range(keep):  # still in their slots
            c = n_chunks - 1 - i
            s = (base + c) % STAGES
            _grad_chunk(ring, s, c, offs, bias, target, scale, grad_row, n_vocab, CHUNK, LANE, layout, TARGET_AFTER)
            gl.thread_barrier()
            mbarrier.arrive(free.index(s), count=1)
        for i in range(n_chunks - keep):  # read again
            c = n_chunks - keep - 1 - i
            k = base + n_chunks + i
            s = k % STAGES
            mbarrier.wait(ready.index(s), (k // STAGES) & 1)
            _grad_chunk(ring, s, c, offs, bias, target, scale, grad_row, n_vocab, CHUNK, LANE, layout, TARGET_AFTER)
            gl.thread_barrier()
            mbarrier.arrive(free.index(s), count=1)
        if TARGET_AFTER:
            gl.thread_barrier()
            gt = gl.exp2(x_t * k2 - bias) - scale
            gl.store(grad_row + target, gt.to(ring.dtype), mask=in_vocab)


@gluon.jit
def ce_keep_kernel(desc, logits_ptr, stride, target_ptr, row_loss_ptr, grad_ptr, gstride, n_rows, n_vocab, scale,
                   CHUNK: gl.constexpr, W: gl.constexpr, STAGES: gl.constexpr, KEEP: gl.constexpr,
                   LANE: gl.constexpr, TARGET_AFTER: gl.constexpr, num_warps: gl.constexpr):
    R: gl.constexpr = CHUNK // W
    ring = gl.allocate_shared_memory(desc.dtype, [STAGES, R, W], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(free.index(slot), count=1)
    fence_async_shared()
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n_chunks = gl.cdiv(n_vocab, CHUNK)
    keep = gl.minimum(n_chunks, KEEP)
    my_rows = gl.cdiv(gl.maximum(n_rows - pid, 0), programs)
    gl.warp_specialize([
        (_compute, (ring, ready, free, logits_ptr, stride, target_ptr, row_loss_ptr, grad_ptr, gstride,
                    pid, programs, my_rows, n_chunks, keep, n_vocab, scale, CHUNK, LANE, STAGES, TARGET_AFTER,
                    num_warps)),
        (_loads, (desc, ring, ready, free, pid, programs, my_rows, n_chunks, keep, n_vocab // W, R, STAGES)),
    ], [1], [24])


def seg_width(n_vocab: int, chunk: int) -> int:
    for w in (256, 128, 64, 32):
        if n_vocab % w == 0 and chunk // w <= 256:
            return w
    raise ValueError(f"vocab {n_vocab} not a multiple of 32")


def run(x, t, chunk, stages, keep, warps, target_after=True):
    n_rows, n_vocab = x.shape
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    grad = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    w = seg_width(n_vocab, chunk)
    flat = x.view(-1, w)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [chunk // w, w], layout)
    ce_keep_kernel[(min(n_rows, sms),)](desc, x, x.stride(0), t, row_loss, grad, grad.stride(0), n_rows, n_vocab,
                                        1.0 / n_rows, CHUNK=chunk, W=w, STAGES=stages, KEEP=keep, LANE=8,
                                        TARGET_AFTER=target_after, num_warps=warps)
    return row_loss, grad


CONFIGS = [  # chunk, stages, keep, warps, target after
    (8192, 13, 10, 8, True),
    (8192, 13, 8, 8, True),
    (8192, 13, 10, 4, True),
    (8192, 13, 0, 8, True),
    (4096, 26, 20, 8, True),
    (4096, 26, 16, 8, True),
    (8192, 13, 11, 8, True),
    (8192, 13, 10, 8, False),
]
