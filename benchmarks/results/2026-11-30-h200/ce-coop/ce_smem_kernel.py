"""Cross-entropy loss and gradient with most of each row kept in shared memory, written in Gluon
(Triton's dialect with explicit shared memory and asynchronous copies).

The gradient needs the row's log-sum-exp before its first element, so the Triton kernel reads every
row twice (the second time partly from L2). Here one program an SM walks rows in turn, in chunks of
CHUNK logits: the first SLOTS chunks of a row (208 KB of a 256 KB bf16 row at 128256 classes) go by
cp.async into shared-memory slots and are read back from there for the gradient; the rest, the row's
tail, is loaded twice, the second time from L2 (a few tens of KB a program). While the gradient of
row r is written slot by slot, each emptied slot is refilled with the same chunk of the program's next
row, so HBM sees that row's reads and this row's writes at once. Every thread reads back exactly the
elements it copied (one layout for both), so no barrier orders a slot's use and its refill.

It takes bf16/fp16 logits with the gradient, no label smoothing, a vocabulary and row stride that are
multiples of 16 elements, on a Hopper GPU with Triton 3.6's Gluon; the rest goes to the Triton kernels.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from fuselab.kernels._launch import cdiv
from fuselab.kernels._validate import INTERPRETED

# Logits a chunk holds (16 KB of bf16), slots at most (13 x 16 KB = 208 KB of the 227 KB an SM has),
# logits a running (max, sum) covers (one 16-byte load), warps, targets one step of the count reads.
CHUNK = 8192
_MAX_SLOTS = 13
_LANE = 8
_WARPS = 8
_COUNT_BLOCK = 1024


@gluon.jit
def _lanes_update(x, lane_m, lane_s):
    """Folds a chunk [CHUNK // LANE, LANE] into the running (max, sum of exp(x - max)) of each lane, all
    within the thread that loaded the lane: no reduction across threads until the row's end."""
    new_m = gl.maximum(lane_m, gl.max(x, axis=1))
    shift = gl.where(new_m == float("-inf"), 0.0, new_m)
    log2e: gl.constexpr = 1.4426950408889634
    lane_s = lane_s * gl.exp2((lane_m - shift) * log2e) + gl.sum(gl.exp2((x - shift[:, None]) * log2e), axis=1)
    return new_m, lane_s


@gluon.jit
def _grad_chunk(x, cols, lse, target, scale):
    """(softmax - onehot(target)) · scale for one chunk."""
    g = gl.exp2((x - lse) * 1.4426950408889634)
    return gl.where(cols == target, g - 1.0, g) * scale


@gluon.jit
def _cross_entropy_smem_kernel(logits_ptr, stride, target_ptr, target_stride, row_loss_ptr, grad_ptr, grad_stride,
                               n_rows, n_vocab, ignore_index,
                               MEAN: gl.constexpr, CHUNK: gl.constexpr, SLOTS: gl.constexpr, LANE: gl.constexpr,
                               COUNT_BLOCK: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, LANE], [32, 1], [num_warps, 1], [1, 0])
    lane_layout: gl.constexpr = gl.SliceLayout(1, layout)
    dtype: gl.constexpr = logits_ptr.dtype.element_ty
    slots = gl.allocate_shared_memory(dtype, [SLOTS, CHUNK // LANE, LANE], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    offs = gl.arange(0, CHUNK // LANE, layout=lane_layout)[:, None] * LANE + \
        gl.arange(0, LANE, layout=gl.SliceLayout(0, layout))[None, :]
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n_chunks = gl.cdiv(n_vocab, CHUNK)

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

    # The first row's slot chunks, one commit group each: groups complete in order, so waiting for
    # "at most SLOTS - 1 - c outstanding" is waiting for chunk c.
    first_limit = gl.where(pid < n_rows, n_vocab, 0)
    for c in gl.static_range(SLOTS):
        cols = c * CHUNK + offs
        async_copy.async_copy_global_to_shared(slots.index(c), logits_ptr + pid.to(gl.int64) * stride + cols,
                                               mask=cols < first_limit)
        async_copy.commit_group()

    for row in range(pid, n_rows, programs):
        row = row.to(gl.int64)
        row_ptr = logits_ptr + row * stride
        lane_m = gl.full([CHUNK // LANE], float("-inf"), gl.float32, layout=lane_layout)
        lane_s = gl.zeros([CHUNK // LANE], gl.float32, layout=lane_layout)
        for c in gl.static_range(SLOTS):
            async_copy.wait_group(SLOTS - 1 - c)
            in_row = c * CHUNK + offs < n_vocab  # masked copies leave stale data behind
            x = gl.where(in_row, slots.index(c).load(layout).to(gl.float32), float("-inf"))
            lane_m, lane_s = _lanes_update(x, lane_m, lane_s)
        for c in range(SLOTS, n_chunks):
            cols = c * CHUNK + offs
            tail = gl.load(row_ptr + cols, mask=cols < n_vocab, other=float("-inf"), eviction_policy="evict_last")
            lane_m, lane_s = _lanes_update(tail.to(gl.float32), lane_m, lane_s)
        row_max = gl.max(lane_m, axis=0)
        shift = gl.where(row_max == float("-inf"), 0.0, row_max)
        lse = shift + gl.log(gl.sum(lane_s * gl.exp2((lane_m - shift) * 1.4426950408889634), axis=0))

        # Targets outside [0, vocab) that are not ignore_index give a NaN loss, as in the Triton kernel.
        target = gl.load(target_ptr + row * target_stride).to(gl.int64)
        valid = target != ignore_index
        in_vocab = (target >= 0) & (target < n_vocab)
        x_t = gl.load(row_ptr + target, mask=in_vocab & valid, other=float("nan")).to(gl.float32)
        gl.store(row_loss_ptr + row, gl.where(valid, lse - x_t, 0.0).to(row_loss_ptr.dtype.element_ty))
        row_scale = gl.where(valid, scale, 0.0)

        grad_row = grad_ptr + row * grad_stride
        for c in range(SLOTS, n_chunks):
            cols = c * CHUNK + offs
            in_row = cols < n_vocab
            tail = gl.load(row_ptr + cols, mask=in_row, other=float("-inf"), eviction_policy="evict_first")
            g = _grad_chunk(tail.to(gl.float32), cols, lse, target, row_scale)
            gl.store(grad_row + cols, g.to(grad_ptr.dtype.element_ty), mask=in_row, cache_modifier=".cs")
        next_ptr = row_ptr + programs * stride
        next_limit = gl.where(row + programs < n_rows, n_vocab, 0)
        for c in gl.static_range(SLOTS):
            cols = c * CHUNK + offs
            in_row = cols < n_vocab
            g = _grad_chunk(slots.index(c).load(layout).to(gl.float32), cols, lse, target, row_scale)
            gl.store(grad_row + cols, g.to(grad_ptr.dtype.element_ty), mask=in_row, cache_modifier=".cs")
            # The store needed this thread's read of the slot: refilling it now cannot overtake the read.
            async_copy.async_copy_global_to_shared(slots.index(c), next_ptr + cols, mask=cols < next_limit)
            async_copy.commit_group()
    async_copy.wait_group(0)


def supports(logits: torch.Tensor, label_smoothing: float) -> bool:
    """Whether this kernel takes a loss-and-gradient call over whole rows."""
    if INTERPRETED or logits.device.type != "cuda" or torch.cuda.get_device_capability(logits.device)[0] != 9:
        return False
    return layout_fits(logits, label_smoothing)


def layout_fits(logits: torch.Tensor, label_smoothing: float) -> bool:
    """The dtypes and layouts the kernel was built for (any device): 16-byte copies need 16-element rows."""
    return (logits.dtype in (torch.bfloat16, torch.float16) and label_smoothing == 0.0
            and logits.stride(1) == 1 and logits.shape[1] % 16 == 0 and logits.stride(0) % 16 == 0
            and logits.data_ptr() % 16 == 0)


def cross_entropy_smem(logits: torch.Tensor, target: torch.Tensor, row_loss: torch.Tensor, grad: torch.Tensor,
                       ignore_index: int, mean: bool, sms: int) -> None:
    """Row losses into `row_loss` and the gradient (scaled by 1 / valid rows if `mean`) into `grad`."""
    n_rows, n_vocab = logits.shape
    _cross_entropy_smem_kernel[(min(n_rows, sms),)](
        logits, logits.stride(0), target, target.stride(0), row_loss, grad, grad.stride(0), n_rows, n_vocab,
        ignore_index, MEAN=mean, CHUNK=CHUNK, SLOTS=min(_MAX_SLOTS, cdiv(n_vocab, CHUNK)), LANE=_LANE,
        COUNT_BLOCK=_COUNT_BLOCK, num_warps=_WARPS,
    )
