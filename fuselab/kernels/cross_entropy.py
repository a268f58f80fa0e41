"""Cross-entropy over a large vocabulary, chunked with an online log-sum-exp.

A program walks a row's vocabulary in chunks, keeping a running max and a running sum of
exponentials, so a 128k vocabulary never exists as float32 logits in memory: logits are read in
their own dtype and upcast chunk by chunk in registers. The loss alone takes one program a row.
With fewer rows than the GPU has SMs to fill (decode, small batches), each row is cut into parts
walked in parallel, whose partial sums a second kernel merges: one program alone would walk a
128k-logit row serially.

Memory behaviour. When the logits need a gradient, the forward pass computes it in the same
kernel, in a second walk over the row (last chunk first, so that part of it is still in L2; one
program an SM takes rows in turn, so that few rows compete for L2), and keeps it in a new buffer of
the logits' shape and dtype until backward; no float32 copy is ever made. The logits themselves are
never written. Backward scales that buffer by the incoming gradient in place and returns it; when
the incoming gradient is 1 (the usual `loss.backward()`), the kernel sees that on the device and
leaves the buffer untouched, so backward costs one near-empty launch and no host sync. Because the
buffer is consumed, backward can run only once per forward. Without a gradient (inference,
`torch.no_grad()`, logits that do not require grad) the forward pass only reads the logits.
On a Hopper GPU, many rows of contiguous bf16/fp16 logits with a gradient go to a Gluon kernel
instead (`cross_entropy_hopper`), which keeps most of each row in shared memory for both walks.

Targets outside [0, vocab) that are not `ignore_index` give a NaN loss for their row rather than a
device-side assert, so checking them never needs a host sync.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fuselab.kernels._common import indices
from fuselab.kernels._common.launch import cdiv, next_power_of_2, sm_count
from fuselab.kernels._common.optional import optional_gluon
from fuselab.kernels._common.validate import check_float_tensor, needs_autograd

# The Hopper kernel, in Gluon; None on a Triton without it, where the Triton kernels take every call.
hopper = optional_gluon("fuselab.kernels.cross_entropy_hopper")

_REDUCTIONS = ("mean", "sum", "none")
# The longest chunk of a row one step of the walk covers (tests lower it so the multi-chunk path runs
# at small vocabularies): the loss alone, one program a row over 4 warps. With the gradient, a row's
# second walk finds it in L2 only if few rows are walked at once: one program an SM takes rows in turn,
# in chunks four times as long over 32 warps. Chosen by sweeps on an H200 (docs/tuning/cross_entropy-constants.md).
MAX_FUSED_BLOCK = 8192
_GRAD_PROGRAMS_PER_SM = 1
# Neighbouring logits one running (max, sum) of _lse_lanes covers: one 16-byte load of bf16.
_LANE = 8
# With fewer rows than _whole_rows_from, each row is cut into parts walked by programs of their own
# (then merged: _split_finish_kernel), in chunks of SPLIT_CHUNK over _SPLIT_WARPS warps.
SPLIT_CHUNK = 1024
_SPLIT_WARPS = 4
# Row losses one step of _reduce_loss_kernel adds: up to 1024, or 4096 over 8 warps for more rows, whose
# steps would otherwise wait on their loads one after another.
_REDUCE_BLOCK = 1024
_REDUCE_BLOCK_MANY = 4096
# _scale_rows_kernel: rows in turn over two programs an SM, 2 * MAX_FUSED_BLOCK columns a step over 16 warps.
_SCALE_PROGRAMS_PER_SM = 2
_SCALE_WARPS = 16
# Targets one step of _count_valid reads.
_COUNT_BLOCK = 4096


@triton.jit
def _exp(x):
    # exp by the one special-function instruction; `tl.exp` adds four for the denormal range, which
    # showed in the walks' time (docs/tuning/cross_entropy-constants.md).
    return tl.math.exp2(x * 1.4426950408889634)


@triton.jit
def _finite(m):
    """A running maximum to shift exponents by: -inf (nothing but -inf seen yet) shifts by 0, so that
    exp(-inf - shift) is 0 rather than exp(-inf + inf) = NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _lse_walk(logits_row, lo, hi, HAS_SMOOTHING: tl.constexpr, CHUNK: tl.constexpr):
    """Online log-sum-exp over logits [lo, hi) of a row: (max, sum of exp(x - finite max), plain sum
    of the logits, which label smoothing needs)."""
    cols = tl.arange(0, CHUNK)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.zeros([], tl.float32)
    logit_sum = tl.zeros([], tl.float32)
    for start in range(lo, hi, CHUNK):
        offs = start + cols
        in_range = offs < hi
        x = tl.load(logits_row + offs, mask=in_range, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        shift = _finite(new_max)
        running_sum = running_sum * _exp(running_max - shift) + tl.sum(_exp(x - shift), axis=0)
        running_max = new_max
        if HAS_SMOOTHING:
            logit_sum += tl.sum(tl.where(in_range, x, 0.0), axis=0)
    return running_max, running_sum, logit_sum


@triton.jit
def _lse_lanes(logits_row, n_vocab, HAS_SMOOTHING: tl.constexpr, CHUNK: tl.constexpr, LANE: tl.constexpr):
    """`_lse_walk` over a whole row with a running (max, sum) per lane of LANE neighbouring logits, merged
    once at the row's end: each chunk is reduced inside the threads that loaded it, so no step waits at
    a block-wide reduction for the slowest warp's loads. The gradient's walk reads the row again right
    after, so its lines are marked to stay in L2."""
    lanes = tl.arange(0, CHUNK // LANE)
    offs_lane = lanes[:, None] * LANE + tl.arange(0, LANE)[None, :]
    lane_max = tl.full([CHUNK // LANE], float("-inf"), tl.float32)
    lane_sum = tl.zeros([CHUNK // LANE], tl.float32)
    logit_sum = tl.zeros([CHUNK // LANE], tl.float32)
    for start in range(0, n_vocab, CHUNK):
        offs = start + offs_lane
        in_range = offs < n_vocab
        x = tl.load(logits_row + offs, mask=in_range, other=float("-inf"), eviction_policy="evict_last").to(tl.float32)
        new_max = tl.maximum(lane_max, tl.max(x, axis=1))
        shift = _finite(new_max)
        lane_sum = lane_sum * _exp(lane_max - shift) + tl.sum(_exp(x - shift[:, None]), axis=1)
        lane_max = new_max
        if HAS_SMOOTHING:
            logit_sum += tl.sum(tl.where(in_range, x, 0.0), axis=1)
    row_max = tl.max(lane_max, axis=0)
    return row_max, tl.sum(lane_sum * _exp(lane_max - _finite(row_max)), axis=0), tl.sum(logit_sum, axis=0)


@triton.jit
def _row_loss(logits_row, target, n_vocab, lse, logit_sum, label_smoothing, HAS_SMOOTHING: tl.constexpr):
    target_in_vocab = (target >= 0) & (target < n_vocab)
    target_logit = tl.load(logits_row + target, mask=target_in_vocab, other=float("nan")).to(tl.float32)
    if HAS_SMOOTHING:
        # (1 - s) * (lse - x_t) + s * mean_j(lse - x_j)
        loss = lse - (1.0 - label_smoothing) * target_logit - label_smoothing * (logit_sum / n_vocab)
    else:
        loss = lse - target_logit
    return loss


@triton.jit
def _write_grad(
    logits_row, grad_row, target, lo, hi, lse, scale, n_vocab, label_smoothing,
    HAS_SMOOTHING: tl.constexpr, CHUNK: tl.constexpr,
):
    """d loss / d x_j = softmax_j - (1 - s) [j == t] - s / V, times the reduction's scale, for j in [lo, hi).

    Walks the chunks last to first: the log-sum-exp's walk read the last ones most recently, so they are
    the likeliest still in L2. Its reads are the lines' last use and its stores are not read again
    here, so both are marked to leave L2 first (docs/tuning/cross_entropy-constants.md)."""
    cols = tl.arange(0, CHUNK)
    n_chunks = tl.cdiv(hi - lo, CHUNK)
    for i in range(0, n_chunks):
        offs = lo + (n_chunks - 1 - i) * CHUNK + cols
        in_range = offs < hi
        x = tl.load(logits_row + offs, mask=in_range, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
        grad = _exp(x - lse)
        if HAS_SMOOTHING:
            grad = grad - label_smoothing / n_vocab
        grad = tl.where(offs == target, grad - (1.0 - label_smoothing), grad) * scale
        tl.store(grad_row + offs, grad.to(grad_row.dtype.element_ty), mask=in_range, cache_modifier=".cs")


@triton.jit
def _count_valid(target_ptr, target_stride, n_rows, ignore_index, BLOCK: tl.constexpr):
    """How many of the n_rows targets are not ignore_index, as a float: every program that scales a
    "mean" gradient counts them itself, which saves the three launches of torch's count."""
    count = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        target = tl.load(target_ptr + rows.to(tl.int64) * target_stride, mask=rows < n_rows, other=ignore_index)
        count += (target != ignore_index).to(tl.float32)
    return tl.sum(count, axis=0)


@triton.jit
def _zero_grad(grad_row, lo, hi, CHUNK: tl.constexpr):
    cols = tl.arange(0, CHUNK)
    for start in range(lo, hi, CHUNK):
        offs = start + cols
        tl.store(grad_row + offs, tl.zeros([CHUNK], tl.float32).to(grad_row.dtype.element_ty), mask=offs < hi)


@triton.jit
def _cross_entropy_kernel(
    logits_ptr, logits_row_stride,
    target_ptr, target_stride,
    row_loss_ptr,
    grad_ptr, grad_row_stride,
    n_rows, n_vocab, ignore_index, label_smoothing,
    HAS_SMOOTHING: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    MEAN: tl.constexpr,
    CHUNK: tl.constexpr,
    COUNT_BLOCK: tl.constexpr,
    LANE: tl.constexpr,
):
    """Whole rows, one after another, program p taking rows p, p + programs, ... (one row each when the
    grid covers them; the gradient's grid is smaller)."""
    scale = 1.0
    if WRITE_GRAD and MEAN:
        scale = 1.0 / _count_valid(target_ptr, target_stride, n_rows, ignore_index, COUNT_BLOCK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(row, tl.int64)
        logits_row = logits_ptr + row * logits_row_stride
        grad_row = grad_ptr + row * grad_row_stride
        target = tl.load(target_ptr + row * target_stride).to(tl.int64)

        if target == ignore_index:
            tl.store(row_loss_ptr + row, tl.zeros([], tl.float32).to(row_loss_ptr.dtype.element_ty))
            if WRITE_GRAD:
                _zero_grad(grad_row, 0, n_vocab, CHUNK)
        else:
            if WRITE_GRAD:
                running_max, running_sum, logit_sum = _lse_lanes(logits_row, n_vocab, HAS_SMOOTHING, CHUNK, LANE)
            else:
                running_max, running_sum, logit_sum = _lse_walk(logits_row, 0, n_vocab, HAS_SMOOTHING, CHUNK)
            lse = _finite(running_max) + tl.log(running_sum)

            loss = _row_loss(logits_row, target, n_vocab, lse, logit_sum, label_smoothing, HAS_SMOOTHING)
            tl.store(row_loss_ptr + row, loss.to(row_loss_ptr.dtype.element_ty))
            if WRITE_GRAD:
                _write_grad(logits_row, grad_row, target, 0, n_vocab, lse, scale, n_vocab, label_smoothing,
                            HAS_SMOOTHING, CHUNK)


@triton.jit
def _split_lse_kernel(
    logits_ptr, logits_row_stride, target_ptr, target_stride, part_ptr, part_plane,
    n_vocab, span, ignore_index,
    HAS_SMOOTHING: tl.constexpr, CHUNK: tl.constexpr,
):
    """Few rows: program (split, row) takes logits [split · span, (split + 1) · span) of its row and
    writes that part's (max, sum of exponentials, sum of logits) to planes 0, 1, 2 of `part_ptr`."""
    split = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    target = tl.load(target_ptr + row * target_stride).to(tl.int64)
    part_max = tl.full([], float("-inf"), tl.float32)
    part_sum = tl.zeros([], tl.float32)
    part_logits = tl.zeros([], tl.float32)
    if target != ignore_index:
        lo = split * span
        part_max, part_sum, part_logits = _lse_walk(
            logits_ptr + row * logits_row_stride, lo, tl.minimum(lo + span, n_vocab), HAS_SMOOTHING, CHUNK
        )
    out = part_ptr + row * tl.num_programs(0) + split
    tl.store(out, part_max)
    tl.store(out + part_plane, part_sum)
    tl.store(out + 2 * part_plane, part_logits)


@triton.jit
def _split_finish_kernel(
    logits_ptr, logits_row_stride, target_ptr, target_stride, part_ptr, part_plane, n_splits,
    row_loss_ptr, grad_ptr, grad_row_stride, n_rows,
    n_vocab, span, ignore_index, label_smoothing,
    HAS_SMOOTHING: tl.constexpr, WRITE_GRAD: tl.constexpr, MEAN: tl.constexpr, CHUNK: tl.constexpr,
    SPLITS: tl.constexpr, ROWS: tl.constexpr,
):
    """Merges a row's parts into its log-sum-exp; split 0 stores the loss and, with WRITE_GRAD, every
    split writes the gradient of its own part (grid: (splits, rows), or (1, rows) without it)."""
    split = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    logits_row = logits_ptr + row * logits_row_stride
    grad_row = grad_ptr + row * grad_row_stride
    target = tl.load(target_ptr + row * target_stride).to(tl.int64)
    lo = split * span
    hi = tl.minimum(lo + span, n_vocab)
    if target == ignore_index:
        if split == 0:
            tl.store(row_loss_ptr + row, tl.zeros([], tl.float32).to(row_loss_ptr.dtype.element_ty))
        if WRITE_GRAD:
            _zero_grad(grad_row, lo, hi, CHUNK)
    else:
        parts = tl.arange(0, SPLITS)
        part_ok = parts < n_splits
        first = part_ptr + row * n_splits + parts
        part_max = tl.load(first, mask=part_ok, other=float("-inf"))
        part_sum = tl.load(first + part_plane, mask=part_ok, other=0.0)
        row_max = tl.max(part_max, axis=0)
        # Each part's sum is relative to its own max (0 when it is -inf, and then the sum is 0 and its
        # factor exp(-inf) = 0): rescale to the row's.
        shift = _finite(row_max)
        lse = shift + tl.log(tl.sum(part_sum * _exp(part_max - shift), axis=0))
        if split == 0:
            logit_sum = tl.sum(tl.load(first + 2 * part_plane, mask=part_ok, other=0.0), axis=0)
            loss = _row_loss(logits_row, target, n_vocab, lse, logit_sum, label_smoothing, HAS_SMOOTHING)
            tl.store(row_loss_ptr + row, loss.to(row_loss_ptr.dtype.element_ty))
        if WRITE_GRAD:
            # The rows are few (ROWS of them at most): counting the valid ones here saves two launches.
            scale = 1.0
            if MEAN:
                scale = 1.0 / _count_valid(target_ptr, target_stride, n_rows, ignore_index, ROWS)
            _write_grad(logits_row, grad_row, target, lo, hi, lse, scale, n_vocab, label_smoothing,
                        HAS_SMOOTHING, CHUNK)


@triton.jit
def _reduce_loss_kernel(
    row_loss_ptr, target_ptr, target_stride, out_ptr, n_rows, ignore_index, MEAN: tl.constexpr, BLOCK: tl.constexpr
):
    """The sum of the row losses, or their mean over the rows not ignored, into out_ptr's dtype: one
    program, so the order of the sum is fixed, and one launch where torch's sum, count, division and
    cast take five. No valid row: 0 / 0 = NaN, as torch gives."""
    total = tl.zeros([BLOCK], tl.float32)
    valid = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        in_batch = rows < n_rows
        total += tl.load(row_loss_ptr + rows, mask=in_batch, other=0.0)
        if MEAN:
            target = tl.load(target_ptr + rows.to(tl.int64) * target_stride, mask=in_batch, other=ignore_index)
            valid += (target != ignore_index).to(tl.float32)
    loss = tl.sum(total, axis=0)
    if MEAN:
        loss = loss / tl.sum(valid, axis=0)
    tl.store(out_ptr, loss.to(out_ptr.dtype.element_ty))


@triton.jit
def _scale_rows_kernel(grad_ptr, grad_row_stride, factor_ptr, factor_stride, n_rows, n_cols, CHUNK: tl.constexpr):
    # Rows in turn over a grid of a few programs an SM: in the common case, d(loss)/d(loss) = 1, each
    # row costs one load of the factor (skipped on the device instead of asking the host), and one
    # program a row would cost more in launching and exiting than that.
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(row, tl.int64)
        factor = tl.load(factor_ptr + row * factor_stride).to(tl.float32)
        if factor != 1.0:
            grad_row = grad_ptr + row * grad_row_stride
            cols = tl.arange(0, CHUNK)
            for start in range(0, n_cols, CHUNK):
                offs = start + cols
                in_row = offs < n_cols
                g = tl.load(grad_row + offs, mask=in_row).to(tl.float32)
                tl.store(grad_row + offs, (g * factor).to(grad_ptr.dtype.element_ty), mask=in_row)


@functools.lru_cache(maxsize=1024)
def _vocab_splits(n_rows: int, n_vocab: int, split_chunk: int, sms: int, whole_from: int) -> tuple[int, int]:
    """(parts per row, logits per part): 1 part from `whole_from` rows on; below, each row is cut, in
    multiples of `split_chunk`, into enough parts for 8 programs an SM (a part's chunks are walked one
    after another, each waiting on its loads)."""
    if n_rows >= whole_from:
        return 1, n_vocab
    wanted = min(cdiv(8 * sms, max(n_rows, 1)), cdiv(n_vocab, split_chunk))
    if n_rows == 0 or wanted < 2:
        return 1, n_vocab
    span = cdiv(cdiv(n_vocab, wanted), split_chunk) * split_chunk
    return cdiv(n_vocab, span), span


def _whole_rows_from(sms: int, write_grad: bool) -> int:
    """Rows from which each row is walked whole by one program (`_cross_entropy_kernel`) rather than
    split: 8 programs an SM for the loss alone; for loss and gradient, half as many rows as SMs, where
    the two crossed on an H200 (docs/tuning/cross_entropy-constants.md)."""
    return cdiv(sms, 2) if write_grad else 8 * sms


def _launch_config(n_vocab: int, writes: bool) -> tuple[int, int]:
    """(chunk, warps) of a walk that only reads the logits, or also writes a row of the same length."""
    if writes:
        return min(4 * MAX_FUSED_BLOCK, max(_LANE, next_power_of_2(n_vocab))), 32
    return min(MAX_FUSED_BLOCK, next_power_of_2(n_vocab)), 4


def _check_inputs(logits, target, ignore_index, reduction, label_smoothing) -> None:
    check_float_tensor("logits", logits)
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices, got {target.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [rows, vocab], got shape {tuple(logits.shape)}")
    if target.shape != logits.shape[:1]:
        raise ValueError(f"target must have shape [{logits.shape[0]}] to match logits {tuple(logits.shape)}, got {tuple(target.shape)}")
    if logits.shape[1] == 0:
        raise ValueError(f"logits must have a vocabulary of at least one class, got shape {tuple(logits.shape)}")
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but logits are on {logits.device}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not (0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def _cross_entropy_forward(logits, target, ignore_index, reduction, label_smoothing, write_grad):
    """Returns (loss in the logits' dtype, gradient buffer or None)."""
    n_rows, n_vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    # Row losses: the result itself under "none", else fp32 for _reduce_loss_kernel.
    row_loss = torch.empty(n_rows, dtype=logits.dtype if reduction == "none" else torch.float32, device=logits.device)
    grad = torch.empty((n_rows, n_vocab), dtype=logits.dtype, device=logits.device) if write_grad else None
    sms = sm_count(logits.device)
    n_splits, span = _vocab_splits(n_rows, n_vocab, SPLIT_CHUNK, sms, _whole_rows_from(sms, write_grad))
    flags = dict(HAS_SMOOTHING=label_smoothing > 0.0, WRITE_GRAD=write_grad, MEAN=reduction == "mean")
    grad_args = (grad if write_grad else row_loss, grad.stride(0) if write_grad else 0)
    if n_splits > 1:
        parts = torch.empty((3, n_rows, n_splits), dtype=torch.float32, device=logits.device)
        _split_lse_kernel[(n_splits, n_rows)](
            logits, logits.stride(0), target, target.stride(0), parts, n_rows * n_splits, n_vocab, span, ignore_index,
            CHUNK=SPLIT_CHUNK, num_warps=_SPLIT_WARPS, HAS_SMOOTHING=flags["HAS_SMOOTHING"],
        )
        _split_finish_kernel[(n_splits if write_grad else 1, n_rows)](
            logits, logits.stride(0), target, target.stride(0), parts, n_rows * n_splits, n_splits,
            row_loss, *grad_args, n_rows, n_vocab, span, ignore_index, float(label_smoothing),
            CHUNK=SPLIT_CHUNK, SPLITS=next_power_of_2(n_splits), ROWS=next_power_of_2(n_rows),
            num_warps=_SPLIT_WARPS, **flags,
        )
    elif write_grad and hopper is not None and hopper.supports(logits, label_smoothing, sms):
        hopper.cross_entropy_hopper(logits, target, row_loss, grad, ignore_index, reduction == "mean", sms)
    elif n_rows > 0:
        chunk, num_warps = _launch_config(n_vocab, write_grad)
        programs = min(n_rows, _GRAD_PROGRAMS_PER_SM * sms) if write_grad else n_rows
        _cross_entropy_kernel[(programs,)](
            logits, logits.stride(0), target, target.stride(0), row_loss, *grad_args,
            n_rows, n_vocab, ignore_index, float(label_smoothing), CHUNK=chunk, COUNT_BLOCK=_COUNT_BLOCK,
            LANE=_LANE, num_warps=num_warps, **flags,
        )
    if reduction == "none":
        return row_loss, grad
    loss = torch.empty((), dtype=logits.dtype, device=logits.device)
    block, num_warps = (_REDUCE_BLOCK, 4) if n_rows <= _REDUCE_BLOCK else (_REDUCE_BLOCK_MANY, 8)
    _reduce_loss_kernel[(1,)](
        row_loss, target, target.stride(0), loss, n_rows, ignore_index, MEAN=reduction == "mean",
        BLOCK=block, num_warps=num_warps,
    )
    return loss, grad


def _scale_rows_(grad: torch.Tensor, factor: torch.Tensor) -> None:
    """grad[r, :] *= factor[r] (or the scalar factor) in place."""
    n_rows, n_cols = grad.shape
    if n_rows == 0:
        return
    factor_stride = factor.stride(0) if factor.dim() == 1 else 0
    chunk = min(2 * MAX_FUSED_BLOCK, next_power_of_2(n_cols))
    programs = min(n_rows, _SCALE_PROGRAMS_PER_SM * sm_count(grad.device))
    _scale_rows_kernel[(programs,)](
        grad, grad.stride(0), factor, factor_stride, n_rows, n_cols, CHUNK=chunk, num_warps=_SCALE_WARPS
    )


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, label_smoothing):
        loss, grad = _cross_entropy_forward(logits, target, ignore_index, reduction, label_smoothing, write_grad=True)
        ctx.grad_logits = grad
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad = ctx.grad_logits
        if grad is None:
            raise RuntimeError("cross_entropy: backward ran twice; its gradient buffer is consumed by the first backward")
        ctx.grad_logits = None
        # Read in its own dtype (the kernel upcasts): a cast here would be one more launch.
        _scale_rows_(grad, grad_loss)
        return grad, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    check_indices: bool | None = None,
) -> torch.Tensor:
    """Cross-entropy of `logits` [rows, vocab] against class indices `target` [rows], like
    `torch.nn.functional.cross_entropy`, computed in float32 without a float32 copy of the logits.

    Rows whose target is `ignore_index` contribute no loss and no gradient; "mean" divides by the
    number of the other rows. The loss has the logits' dtype.

    A target outside [0, vocab) that is not ignore_index gives its row a NaN loss (no read outside
    the logits, no host sync). check_indices=True (default: the FUSELAB_CHECK_INDICES environment
    variable) checks the targets on the host first, a sync, and raises ValueError naming the first such.
    """
    _check_inputs(logits, target, ignore_index, reduction, label_smoothing)
    if indices.requested(check_indices, logits.device):
        indices.check_targets(target, logits.shape[1], ignore_index)
    if needs_autograd(logits):
        return CrossEntropyFunction.apply(logits, target, ignore_index, reduction, label_smoothing)
    loss, _ = _cross_entropy_forward(logits, target, ignore_index, reduction, label_smoothing, write_grad=False)
    return loss
