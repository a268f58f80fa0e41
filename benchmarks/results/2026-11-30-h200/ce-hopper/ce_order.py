"""Experiment: the merged kernel with the first walk's order as a switch (kept chunks first or streamed first).

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-hopper/drive.py ce_order 8192
"""

from __future__ import annotations

import inspect

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fuselab.kernels._validate import INTERPRETED

# Logits a chunk holds (16 KB of bf16), shared-memory slots (13 x 16 KB = 208 KB of the 227 KB an SM
# has), slots whose chunk both walks use (the other 3 stream, enough to cover a DRAM load's latency).
# Measured at 8192 x 128256 bf16: keep 10 of 13 took 1192 us, 9 1206, 8 1229, 7 1236, 11 1273 (too few
# streaming slots); 4096-logit chunks (26 slots, keep 18 / 20 / 22): 1223 / 1233 / 1301; 16 compute warps
# 1201 against 8 (ce-hopper/ce_keep2*.txt).
CHUNK = 8192
_STAGES = 13
_KEEP = 10
_WARPS = 8
# Logits a running (max, sum) covers (one 16-byte load), targets one step of the "mean" count reads.
_LANE = 8
_COUNT_BLOCK = 1024
# Registers a thread of each load warp asks for (setmaxnreg): the compute warps take the rest.
_LOAD_REGS = 24
# From 12 rows an SM on (ce-hopper/ce_rows.txt): the Triton kernel was faster up to 1056 rows (8 an SM:
# 181-183 against 178.5-178.7 us; 528 rows: 97-99 against 94-95), this one from 2048 (15.5 an SM: 332-333
# against 342-343; 8192 rows: 1195-1198 against 1331).
ROWS_PER_SM = 12

# --------------------------------------------------------------------------------------------
# Gluon kernel
# --------------------------------------------------------------------------------------------


@gluon.jit
def _keep_loads(desc, ring, ready, free, pid, programs, my_rows, keep, segs_per_row, R: gl.constexpr):
    """Load warp: chunk i of each row into slot i, once the last row's gradient has freed it."""
    for row_i in range(my_rows):
        row = pid + row_i * programs
        for i in range(keep):
            # A fresh barrier counts the phase before its first as complete: the first row does not wait.
            mbarrier.wait(free.index(i), (row_i & 1) ^ 1)
            mbarrier.expect(ready.index(i), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [row * segs_per_row + i * R, 0], ready.index(i), ring.index(i))


@gluon.jit
def _stream_loads(desc, ring, ready, free, pid, programs, my_rows, keep, n_chunks, segs_per_row,
                  R: gl.constexpr, KEEP: gl.constexpr, STAGES: gl.constexpr):
    """Load warp: chunks keep..C-1 of each row twice (one per walk) through slots KEEP..STAGES-1 in turn."""
    streams: gl.constexpr = STAGES - KEEP
    n_stream = n_chunks - keep
    k = 0
    for row_i in range(my_rows):
        row = pid + row_i * programs
        for j in range(2 * n_stream):
            c = keep + j % n_stream
            s = KEEP + k % streams
            mbarrier.wait(free.index(s), ((k // streams) & 1) ^ 1)
            mbarrier.expect(ready.index(s), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(desc, [row * segs_per_row + c * R, 0], ready.index(s), ring.index(s))
            k += 1


@gluon.jit
def _read_slot(ring, s, layout: gl.constexpr, CHUNK: gl.constexpr, LANE: gl.constexpr):
    """Slot s as [CHUNK // LANE, LANE]: each thread reads LANE neighbouring logits (the TMA layout is
    unswizzled, so this is the same bytes in row-major order)."""
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    return ring.index(s)._reinterpret(ring.dtype, [CHUNK // LANE, LANE], flat).load(layout)


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
    """softmax · scale = exp2(x · log2e - bias) for chunk c (0 on an ignored row); streaming stores."""
    cols = c * CHUNK + offs
    g = gl.where(valid, gl.exp2(x.to(gl.float32) * 1.4426950408889634 - bias), 0.0)
    gl.store(grad_row + cols, g.to(grad_row.dtype.element_ty), mask=cols < n_vocab, cache_modifier=".cs")


@gluon.jit
def _compute(ring, ready, free, logits_ptr, stride, target_ptr, target_stride, row_loss_ptr, grad_ptr,
             n_rows, n_vocab, ignore_index, pid, programs, my_rows, n_chunks, keep,
             MEAN: gl.constexpr, CHUNK: gl.constexpr, LANE: gl.constexpr, KEEP: gl.constexpr,
             STAGES: gl.constexpr, COUNT_BLOCK: gl.constexpr, KEEP_FIRST: gl.constexpr, num_warps: gl.constexpr):
    streams: gl.constexpr = STAGES - KEEP
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

    n_stream = n_chunks - keep
    k = 0  # streamed chunks consumed so far
    for row_i in range(my_rows):
        row = (pid + row_i * programs).to(gl.int64)
        target = gl.load(target_ptr + row * target_stride).to(gl.int64)
        valid = target != ignore_index
        # Targets outside [0, vocab) that are not ignore_index give a NaN loss, as in the Triton kernel.
        in_vocab = (target >= 0) & (target < n_vocab)
        x_t = gl.load(logits_ptr + row * stride + gl.where(in_vocab, target, 0)).to(gl.float32)
        x_t = gl.where(in_vocab, x_t, float("nan"))

        lane_m = gl.full([CHUNK // LANE], float("-inf"), gl.float32, layout=lane_layout)
        lane_s = gl.zeros([CHUNK // LANE], gl.float32, layout=lane_layout)
        if KEEP_FIRST:
            for i in range(keep):
                mbarrier.wait(ready.index(i), row_i & 1)
                lane_m, lane_s = _fold(_read_slot(ring, i, layout, CHUNK, LANE), i, offs, n_vocab, lane_m, lane_s, CHUNK)
        for j in range(n_stream):
            s = KEEP + k % streams
            mbarrier.wait(ready.index(s), (k // streams) & 1)
            x = _read_slot(ring, s, layout, CHUNK, LANE)
            gl.thread_barrier()  # every compute warp has read the slot
            mbarrier.arrive(free.index(s), count=1)
            lane_m, lane_s = _fold(x, keep + j, offs, n_vocab, lane_m, lane_s, CHUNK)
            k += 1
        if not KEEP_FIRST:
            for i in range(keep):
                mbarrier.wait(ready.index(i), row_i & 1)
                lane_m, lane_s = _fold(_read_slot(ring, i, layout, CHUNK, LANE), i, offs, n_vocab, lane_m, lane_s, CHUNK)
        row_max = gl.max(lane_m, axis=0)
        shift = gl.where(row_max == float("-inf"), 0.0, row_max)
        lse = shift + gl.log(gl.sum(lane_s * gl.exp2((lane_m - shift) * log2e), axis=0))
        gl.store(row_loss_ptr + row, gl.where(valid, lse - x_t, 0.0).to(row_loss_ptr.dtype.element_ty))

        # exp(x - lse) · scale = exp2(x · log2e - (lse · log2e - log2(scale)))
        bias = lse * log2e - log2_scale
        grad_row = grad_ptr + row * n_vocab
        for j in range(n_stream):
            s = KEEP + k % streams
            mbarrier.wait(ready.index(s), (k // streams) & 1)
            x = _read_slot(ring, s, layout, CHUNK, LANE)
            gl.thread_barrier()
            mbarrier.arrive(free.index(s), count=1)
            _write_grad(x, keep + j, offs, bias, valid, grad_row, n_vocab, CHUNK)
            k += 1
        for i in range(keep):
            x = _read_slot(ring, i, layout, CHUNK, LANE)
            gl.thread_barrier()
            mbarrier.arrive(free.index(i), count=1)
            _write_grad(x, i, offs, bias, valid, grad_row, n_vocab, CHUNK)
        # The target's logit: its gradient less `scale`, stored after every compute warp's stores of the row
        # (one scalar store instead of a compare per logit).
        gl.thread_barrier()
        g_t = gl.exp2(x_t * log2e - bias) - scale
        gl.store(grad_row + target, g_t.to(grad_ptr.dtype.element_ty), mask=valid & in_vocab)


@gluon.jit
def _cross_entropy_hopper_kernel(desc, logits_ptr, target_ptr, target_stride, row_loss_ptr, grad_ptr,
                                 n_rows, n_vocab, ignore_index,
                                 MEAN: gl.constexpr, CHUNK: gl.constexpr, SEG: gl.constexpr,
                                 STAGES: gl.constexpr, KEEP: gl.constexpr, LANE: gl.constexpr,
                                 COUNT_BLOCK: gl.constexpr, LOAD_REGS: gl.constexpr, KEEP_FIRST: gl.constexpr, num_warps: gl.constexpr):
    """Grid: one program an SM (at most one a row), rows pid, pid + programs, ... `desc` views the logits
    as [rows · vocab / SEG, SEG]: a chunk is CHUNK / SEG of its rows (the last chunk of a row runs into the
    next row, or past the end, where TMA fills zeros: both masked)."""
    R: gl.constexpr = CHUNK // SEG
    ring = gl.allocate_shared_memory(desc.dtype, [STAGES, R, SEG], desc.layout)
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
    segs_per_row = n_vocab // SEG
    gl.warp_specialize([
        (_compute, (ring, ready, free, logits_ptr, n_vocab, target_ptr, target_stride, row_loss_ptr, grad_ptr,
                    n_rows, n_vocab, ignore_index, pid, programs, my_rows, n_chunks, keep,
                    MEAN, CHUNK, LANE, KEEP, STAGES, COUNT_BLOCK, KEEP_FIRST, num_warps)),
        (_keep_loads, (desc, ring, ready, free, pid, programs, my_rows, keep, segs_per_row, R)),
        (_stream_loads, (desc, ring, ready, free, pid, programs, my_rows, keep, n_chunks, segs_per_row,
                         R, KEEP, STAGES)),
    ], [1, 1], [LOAD_REGS, LOAD_REGS])


# --------------------------------------------------------------------------------------------
# Host launcher
# --------------------------------------------------------------------------------------------


def _gluon_api_matches() -> bool:
    # Gluon is experimental: its warp_specialize took this form in Triton 3.6 and changes across releases.
    return "functions_and_args" in inspect.signature(gl.warp_specialize).parameters


_API_MATCHES = _gluon_api_matches()


def _segment(n_vocab: int) -> int | None:
    """The widest row of the TMA view (logits a segment) that divides the vocabulary, or None."""
    for seg in (256, 128, 64, 32):
        if n_vocab % seg == 0:
            return seg
    return None


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


def run(x, t, stages, keep, warps, keep_first):
    n_rows, n_vocab = x.shape
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    grad = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    seg = _segment(n_vocab)
    flat = x.view(-1, seg)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [CHUNK // seg, seg], layout)
    _cross_entropy_hopper_kernel[(min(n_rows, sms),)](
        desc, x, t, t.stride(0), row_loss, grad, n_rows, n_vocab, -100,
        MEAN=True, CHUNK=CHUNK, SEG=seg, STAGES=stages, KEEP=keep, LANE=_LANE, COUNT_BLOCK=_COUNT_BLOCK,
        LOAD_REGS=_LOAD_REGS, KEEP_FIRST=keep_first, num_warps=warps,
    )
    return row_loss, grad


CONFIGS = [  # stages, keep, warps, keep first
    (13, 10, 8, False),
    (13, 10, 8, True),
    (13, 9, 8, True),
    (13, 11, 8, True),
    (13, 8, 8, True),
    (13, 10, 4, True),
    (13, 10, 8, False),
]
