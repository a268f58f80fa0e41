"""Cross-entropy's loss and gradient for Hopper (sm_90), written in Gluon, Triton's lower-level dialect,
where shared-memory buffers, TMA copies and barriers are explicit.

Why a second kernel: the gradient needs the row's log-sum-exp before its first element, so the Triton
kernel walks every 256 KB row (128256 bf16 logits) twice, the second time from L2. Its DRAM traffic is
then close to one read and one write, but L2 serves the row three times (two reads, one write) and
became the limit. Here most of a row is read from DRAM into shared memory once and used by both walks:

- a program (one an SM) takes rows one after another from a counter in global memory, so all SMs move
  through the logits together; a row is C chunks of CHUNK logits;
- chunks 0..keep-1 go once into `keep` slots of shared memory (one warp loads them by TMA, the next
  row's chunk i as soon as this row's gradient has read slot i);
- chunks keep..C-1 stream through the remaining slots (a second warp loads them, ahead of use); the
  compute warps hold the first `held` of them in registers for the gradient, and only the rest are
  streamed a second time (from L2);
- the compute warps fold each chunk into per-lane running (max, sum of exponentials), then write the
  gradient chunk by chunk. Both walks take the streamed chunks first, so the next row's streamed chunks
  are already arriving while this row's kept ones are still in use.
Its DRAM traffic is then one read and one write. Rows come from a counter because, dealt out in a fixed
order, the programs drift apart and their traffic spreads over ever more of the tensor (measurements:
docs/tuning/cross_entropy-constants.md).

It takes what it was built and measured for: contiguous bf16/fp16 logits whose vocabulary is a multiple
of 32 (the TMA view), without label smoothing, with a gradient, at least ROWS_PER_SM rows an SM, on a
Hopper GPU with the Gluon of Triton 3.6; everything else goes to the Triton kernels.
"""

from __future__ import annotations

import inspect

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fuselab.kernels._common.launch import cdiv
from fuselab.kernels._common.validate import INTERPRETED

# Logits a chunk holds (16 KB of bf16), shared-memory slots (14 x 16 KB = 224 KB of the 227 KB an SM
# has), slots whose chunk both walks use (the others stream the rest), streamed chunks the compute warps
# hold in registers for the gradient (so only the rest of the row is read twice), compute warps: chosen
# by a sweep on an H200 (docs/tuning/cross_entropy-constants.md). Only the held chunks' code is unrolled:
# with the kept slots' loops unrolled too, the kernel outgrew the instruction cache.
CHUNK = 8192
_STAGES = 14
_KEEP = 9
_HELD = 5
_WARPS = 8
# Logits a running (max, sum) covers (one 16-byte load), targets one step of the "mean" count reads.
_LANE = 8
_COUNT_BLOCK = 1024
# Registers a thread of each load warp asks for (setmaxnreg): the compute warps take the rest.
_LOAD_REGS = 24
# From 7 rows an SM on: below, the Triton kernel was as fast or faster (docs/tuning/cross_entropy-constants.md).
ROWS_PER_SM = 7

# --------------------------------------------------------------------------------------------
# Gluon kernel
# --------------------------------------------------------------------------------------------


@gluon.jit
def _publish_row(rows, row_ready, row_i, row, D: gl.constexpr):
    """The program's row_i-th row (from the counter) into its shared-memory slot, for the other partitions."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    rows.index(row_i % D).store(gl.full([1], row, gl.int32, layout))
    gl.thread_barrier()
    mbarrier.arrive(row_ready.index(row_i % D), count=1)


@gluon.jit
def _next_row(rows, row_ready, row_i, D: gl.constexpr, WARPS: gl.constexpr):
    """The program's row_i-th row, once the load warp that takes rows from the counter has published it."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    mbarrier.wait(row_ready.index(row_i % D), (row_i // D) & 1)
    return gl.max(rows.index(row_i % D).load(layout), axis=0)


@gluon.jit
def _keep_loads(desc, ring, ready, free, rows, row_ready, counter_ptr, n_rows, segs_per_row, R: gl.constexpr,
                KEEP: gl.constexpr, D: gl.constexpr):
    """Load warp: takes the program's rows from the counter (all programs move through the rows together)
    and loads chunk i of each into slot i, once the last row's gradient has freed it."""
    row_i = 0
    row = gl.atomic_add(counter_ptr, 1)
    _publish_row(rows, row_ready, row_i, row, D)
    while row < n_rows:
        for i in range(KEEP):
            # A fresh barrier counts the phase before its first as complete: the first row does not wait.
            mbarrier.wait(free.index(i), (row_i & 1) ^ 1)
            mbarrier.expect(ready.index(i), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [row * segs_per_row + i * R, 0], ready.index(i), ring.index(i))
        row_i += 1
        row = gl.atomic_add(counter_ptr, 1)
        _publish_row(rows, row_ready, row_i, row, D)


@gluon.jit
def _stream_loads(desc, ring, ready, free, rows, row_ready, n_rows, n_chunks, segs_per_row,
                  R: gl.constexpr, KEEP: gl.constexpr, HELD: gl.constexpr, STAGES: gl.constexpr, D: gl.constexpr):
    """Load warp: chunks KEEP..C-1 of each row for the first walk, then KEEP+HELD..C-1 again for the
    gradient's, through slots KEEP..STAGES-1 in turn."""
    streams: gl.constexpr = STAGES - KEEP
    n_stream = n_chunks - KEEP
    k = 0
    row_i = 0
    row = _next_row(rows, row_ready, row_i, D, 1)
    while row < n_rows:
        for j in range(2 * n_stream - HELD):
            c = KEEP + gl.where(j < n_stream, j, j - n_stream + HELD)
            s = KEEP + k % streams
            mbarrier.wait(free.index(s), ((k // streams) & 1) ^ 1)
            mbarrier.expect(ready.index(s), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [row * segs_per_row + c * R, 0], ready.index(s), ring.index(s))
            k += 1
        row_i += 1
        row = _next_row(rows, row_ready, row_i, D, 1)


@gluon.jit
def _read_slot(ring, s, layout: gl.constexpr, CHUNK: gl.constexpr, LANE: gl.constexpr):
    """Slot s as [CHUNK // LANE, LANE]: each thread reads LANE neighbouring logits (the TMA layout is
    unswizzled, so this is the same bytes in row-major order)."""
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    return ring.index(s)._reinterpret(ring.dtype, [CHUNK // LANE, LANE], flat).load(layout)


@gluon.jit
def _take_streamed(ring, ready, free, k, layout: gl.constexpr, CHUNK: gl.constexpr, LANE: gl.constexpr,
                   KEEP: gl.constexpr, STAGES: gl.constexpr):
    """The k-th streamed chunk into registers, its slot handed back to the load warp."""
    streams: gl.constexpr = STAGES - KEEP
    s = KEEP + k % streams
    mbarrier.wait(ready.index(s), (k // streams) & 1)
    x = _read_slot(ring, s, layout, CHUNK, LANE)
    gl.thread_barrier()  # every compute warp has read the slot
    mbarrier.arrive(free.index(s), count=1)
    return x


@gluon.jit
def _fold(x, c, offs, n_vocab, lane_m, lane_s, CHUNK: gl.constexpr):
    """Chunk c into each lane's running (max, sum of exp(x - max)), in log2 units of the max."""
    log2e: gl.constexpr = 1.4426950408889634
    cols = c * CHUNK + offs
    x = gl.where(cols < n_vocab, x.to(gl.float32), float("-inf"))
    new_m = gl.maximum(lane_m, gl.max(x, axis=1))
    shift = gl.where(new_m == float("-inf"), 0.0, new_m) * log2e
    lane_s = lane_s * gl.exp2(lane_m * log2e - shift) + gl.sum(gl.exp2(x * log2e - shift[:, None]), axis=1)
    return new_m, lane_s


@gluon.jit
def _write_grad(x, c, offs, bias, valid, grad_row, n_vocab, CHUNK: gl.constexpr):
    """softmax · scale = exp2(x · log2e - bias) for chunk c (0 on an ignored row). Plain stores: marked
    evict-first (.cs) they were slower."""
    cols = c * CHUNK + offs
    g = gl.where(valid, gl.exp2(x.to(gl.float32) * 1.4426950408889634 - bias), 0.0)
    gl.store(grad_row + cols, g.to(grad_row.dtype.element_ty), mask=cols < n_vocab)


@gluon.jit
def _compute(ring, ready, free, rows, row_ready, logits_ptr, stride, target_ptr, target_stride, row_loss_ptr, grad_ptr,
             n_rows, n_vocab, ignore_index, n_chunks, D: gl.constexpr,
             MEAN: gl.constexpr, CHUNK: gl.constexpr, LANE: gl.constexpr, KEEP: gl.constexpr, HELD: gl.constexpr,
             STAGES: gl.constexpr, COUNT_BLOCK: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, LANE], [32, 1], [num_warps, 1], [1, 0])
    lane_layout: gl.constexpr = gl.SliceLayout(1, layout)
    offs = gl.arange(0, CHUNK // LANE, layout=lane_layout)[:, None] * LANE + \
        gl.arange(0, LANE, layout=gl.SliceLayout(0, layout))[None, :]
    log2e: gl.constexpr = 1.4426950408889634

    # "mean" divides by the rows not ignored: every program counts them itself (no extra launches).
    scale = 1.0
    if MEAN:
        count_layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
        count = gl.zeros([COUNT_BLOCK], gl.float32, layout=count_layout)
        for start in range(0, n_rows, COUNT_BLOCK):
            idx = start + gl.arange(0, COUNT_BLOCK, layout=count_layout)
            t = gl.load(target_ptr + idx.to(gl.int64) * target_stride, mask=idx < n_rows, other=ignore_index)
            count += (t != ignore_index).to(gl.float32)
        scale = 1.0 / gl.sum(count, axis=0)
    log2_scale = gl.log2(scale)

    n_stream = n_chunks - KEEP
    k = 0  # streamed chunks consumed so far
    row_i = 0
    row32 = _next_row(rows, row_ready, row_i, D, num_warps)
    while row32 < n_rows:
        row = row32.to(gl.int64)
        target = gl.load(target_ptr + row * target_stride).to(gl.int64)
        valid = target != ignore_index
        # Targets outside [0, vocab) that are not ignore_index give a NaN loss, as in the Triton kernel.
        in_vocab = (target >= 0) & (target < n_vocab)
        x_t = gl.load(logits_ptr + row * stride + gl.where(in_vocab, target, 0)).to(gl.float32)
        x_t = gl.where(in_vocab, x_t, float("nan"))

        lane_m = gl.full([CHUNK // LANE], float("-inf"), gl.float32, layout=lane_layout)
        lane_s = gl.zeros([CHUNK // LANE], gl.float32, layout=lane_layout)
        # The first HELD streamed chunks stay in registers for the gradient (a tuple, unrolled: registers
        # cannot be indexed at run time).
        held = ()
        for j in gl.static_range(HELD):
            x = _take_streamed(ring, ready, free, k + j, layout, CHUNK, LANE, KEEP, STAGES)
            lane_m, lane_s = _fold(x, KEEP + j, offs, n_vocab, lane_m, lane_s, CHUNK)
            held = held + (x,)
        k += HELD
        for j in range(HELD, n_stream):
            x = _take_streamed(ring, ready, free, k, layout, CHUNK, LANE, KEEP, STAGES)
            lane_m, lane_s = _fold(x, KEEP + j, offs, n_vocab, lane_m, lane_s, CHUNK)
            k += 1
        # Kept slots are read one ahead of the chunk being folded (and below, written), so the shared-memory
        # latency overlaps the exponentials.
        mbarrier.wait(ready.index(0), row_i & 1)
        x = _read_slot(ring, 0, layout, CHUNK, LANE)
        for i in range(1, KEEP):
            mbarrier.wait(ready.index(i), row_i & 1)
            x_next = _read_slot(ring, i, layout, CHUNK, LANE)
            lane_m, lane_s = _fold(x, i - 1, offs, n_vocab, lane_m, lane_s, CHUNK)
            x = x_next
        lane_m, lane_s = _fold(x, KEEP - 1, offs, n_vocab, lane_m, lane_s, CHUNK)
        row_max = gl.max(lane_m, axis=0)
        shift = gl.where(row_max == float("-inf"), 0.0, row_max)
        lse = shift + gl.log(gl.sum(lane_s * gl.exp2((lane_m - shift) * log2e), axis=0))
        gl.store(row_loss_ptr + row, gl.where(valid, lse - x_t, 0.0).to(row_loss_ptr.dtype.element_ty))

        # exp(x - lse) · scale = exp2(x · log2e - (lse · log2e - log2(scale)))
        bias = lse * log2e - log2_scale
        grad_row = grad_ptr + row * n_vocab
        for j in gl.static_range(HELD):
            _write_grad(held[j], KEEP + j, offs, bias, valid, grad_row, n_vocab, CHUNK)
        for j in range(HELD, n_stream):
            x = _take_streamed(ring, ready, free, k, layout, CHUNK, LANE, KEEP, STAGES)
            _write_grad(x, KEEP + j, offs, bias, valid, grad_row, n_vocab, CHUNK)
            k += 1
        x = _read_slot(ring, 0, layout, CHUNK, LANE)
        gl.thread_barrier()  # every compute warp has read the slot
        mbarrier.arrive(free.index(0), count=1)
        for i in range(1, KEEP):
            x_next = _read_slot(ring, i, layout, CHUNK, LANE)
            _write_grad(x, i - 1, offs, bias, valid, grad_row, n_vocab, CHUNK)
            gl.thread_barrier()
            mbarrier.arrive(free.index(i), count=1)
            x = x_next
        _write_grad(x, KEEP - 1, offs, bias, valid, grad_row, n_vocab, CHUNK)
        # The target's logit: its gradient less `scale`, stored after every compute warp's stores of the row
        # (one scalar store instead of a compare per logit).
        gl.thread_barrier()
        g_t = gl.exp2(x_t * log2e - bias) - scale
        gl.store(grad_row + target, g_t.to(grad_ptr.dtype.element_ty), mask=valid & in_vocab)
        row_i += 1
        row32 = _next_row(rows, row_ready, row_i, D, num_warps)


@gluon.jit
def _cross_entropy_hopper_kernel(desc, logits_ptr, target_ptr, target_stride, row_loss_ptr, grad_ptr, counter_ptr,
                                 n_rows, n_vocab, ignore_index,
                                 MEAN: gl.constexpr, CHUNK: gl.constexpr, SEG: gl.constexpr,
                                 STAGES: gl.constexpr, KEEP: gl.constexpr, HELD: gl.constexpr, LANE: gl.constexpr,
                                 COUNT_BLOCK: gl.constexpr, LOAD_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Grid: one program an SM (at most one a row), rows from `counter_ptr` (zeroed). `desc` views the logits
    as [rows · vocab / SEG, SEG]: a chunk is CHUNK / SEG of its rows (the last chunk of a row runs into the
    next row, or past the end, where TMA fills zeros: both masked). KEEP and HELD are at most the row's
    chunks and the streamed ones (`_plan`)."""
    R: gl.constexpr = CHUNK // SEG
    ring = gl.allocate_shared_memory(desc.dtype, [STAGES, R, SEG], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Row numbers pass from the load warp that takes them to the other partitions through D slots: no
    # partition runs more than two rows ahead of another (the chunk slots hold them back), so 4 never wrap.
    D: gl.constexpr = 4
    rows = gl.allocate_shared_memory(gl.int32, [D, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    row_ready = gl.allocate_shared_memory(gl.int64, [D, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(free.index(slot), count=1)
    for slot in gl.static_range(D):
        mbarrier.init(row_ready.index(slot), count=1)
    fence_async_shared()
    n_chunks = gl.cdiv(n_vocab, CHUNK)
    segs_per_row = n_vocab // SEG
    gl.warp_specialize([
        (_compute, (ring, ready, free, rows, row_ready, logits_ptr, n_vocab, target_ptr, target_stride, row_loss_ptr,
                    grad_ptr, n_rows, n_vocab, ignore_index, n_chunks, D,
                    MEAN, CHUNK, LANE, KEEP, HELD, STAGES, COUNT_BLOCK, num_warps)),
        (_keep_loads, (desc, ring, ready, free, rows, row_ready, counter_ptr, n_rows, segs_per_row, R, KEEP, D)),
        (_stream_loads, (desc, ring, ready, free, rows, row_ready, n_rows, n_chunks, segs_per_row,
                         R, KEEP, HELD, STAGES, D)),
    ], [1, 1], [LOAD_REGS, LOAD_REGS])


# --------------------------------------------------------------------------------------------
# Host launcher
# --------------------------------------------------------------------------------------------


def _gluon_api_matches() -> bool:
    # Gluon is experimental: its warp_specialize took this form in Triton 3.6 and changes across releases,
    # and a slot is read back through the (private) reinterpretation of a shared-memory view.
    warp_specialize = getattr(gl, "warp_specialize", None)
    return (warp_specialize is not None and "functions_and_args" in inspect.signature(warp_specialize).parameters
            and hasattr(getattr(gl, "shared_memory_descriptor", None), "_reinterpret"))


_API_MATCHES = _gluon_api_matches()


def _segment(n_vocab: int) -> int | None:
    """The widest row of the TMA view (logits a segment) that divides the vocabulary, or None."""
    for seg in (256, 128, 64, 32):
        if n_vocab % seg == 0:
            return seg
    return None


def _plan(n_vocab: int, keep: int, held: int) -> tuple[int, int]:
    """(chunks kept in shared memory, streamed chunks held in registers) for a row of n_vocab logits."""
    n_chunks = cdiv(n_vocab, CHUNK)
    keep = min(keep, n_chunks)
    return keep, min(held, n_chunks - keep)


def supports(logits: torch.Tensor, label_smoothing: float, sms: int) -> bool:
    """Whether this kernel takes a (validated) loss-and-gradient call."""
    if INTERPRETED or not _API_MATCHES or logits.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(logits.device)[0] != 9:
        return False
    return layout_fits(logits, label_smoothing) and logits.shape[0] >= ROWS_PER_SM * sms


def layout_fits(logits: torch.Tensor, label_smoothing: float) -> bool:
    """The dtypes and layouts the kernel was built for (any device)."""
    return (logits.dtype in (torch.bfloat16, torch.float16) and label_smoothing == 0.0
            and logits.is_contiguous() and _segment(logits.shape[1]) is not None
            and logits.data_ptr() % 16 == 0)


def cross_entropy_hopper(logits: torch.Tensor, target: torch.Tensor, row_loss: torch.Tensor, grad: torch.Tensor,
                         ignore_index: int, mean: bool, sms: int) -> None:
    """Row losses into `row_loss` and the gradient of the sum (or, with `mean`, of the mean over the rows
    not ignored) into `grad` (contiguous, the logits' shape and dtype), for a call `supports` takes."""
    n_rows, n_vocab = logits.shape
    seg = _segment(n_vocab)
    flat = logits.view(-1, seg)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [CHUNK // seg, seg], layout)
    keep, held = _plan(n_vocab, _KEEP, _HELD)
    # One launch to zero it: a counter kept between calls would need resetting and one per stream.
    counter = torch.zeros(1, dtype=torch.int32, device=logits.device)
    _cross_entropy_hopper_kernel[(min(n_rows, sms),)](
        desc, logits, target, target.stride(0), row_loss, grad, counter, n_rows, n_vocab, ignore_index,
        MEAN=mean, CHUNK=CHUNK, SEG=seg, STAGES=_STAGES, KEEP=keep, HELD=held, LANE=_LANE,
        COUNT_BLOCK=_COUNT_BLOCK, LOAD_REGS=_LOAD_REGS, num_warps=_WARPS,
    )

