"""Cross-entropy over a large vocabulary, chunked with an online log-sum-exp.

One program per row walks the vocabulary in chunks, keeping a running max and a running sum of
exponentials, so a 128k vocabulary never exists as float32 logits in memory: logits are read in
their own dtype and upcast chunk by chunk in registers.

Memory behaviour. When the logits need a gradient, the forward pass computes it in the same
kernel (a second walk over the row, which mostly hits L2) and keeps it in a new buffer of the
logits' shape and dtype until backward; no float32 copy is ever made. The logits themselves are
never written. Backward scales that buffer by the incoming gradient in place and returns it; when
the incoming gradient is 1 (the usual `loss.backward()`), the kernel sees that on the device and
leaves the buffer untouched, so backward costs one near-empty launch and no host sync. Because the
buffer is consumed, backward can run only once per forward. Without a gradient (inference,
`torch.no_grad()`, logits that do not require grad) the forward pass only reads the logits.

Targets outside [0, vocab) that are not `ignore_index` give a NaN loss for their row rather than a
device-side assert, so checking them never needs a host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselab.kernels._launch import next_power_of_2
from fuselab.kernels._validate import check_float_tensor, needs_autograd

_REDUCTIONS = ("mean", "sum", "none")
# The longest chunk of a row one step of the walk covers (tests lower it so the multi-chunk path runs
# at small vocabularies). Measured at 8192 x 128256 bf16 (scripts/tune-kernels --only cross_entropy,
# benchmarks/results/2026-11-30-h200/kernels-tuned): the loss alone, one read of each row, is fastest
# with 8192-logit chunks over 4 warps (97% of the copy bandwidth; 32768 over 32 warps reached 63%:
# with two such programs an SM, the block-wide reductions of each chunk leave its loads idle). Loss
# and gradient walk each row twice and are fastest with chunks half as long over 8 warps.
MAX_FUSED_BLOCK = 8192


@triton.jit
def _cross_entropy_kernel(
    logits_ptr, logits_row_stride,
    target_ptr, target_stride,
    row_loss_ptr,
    grad_ptr, grad_row_stride,
    n_valid_ptr,
    n_vocab, ignore_index, label_smoothing,
    HAS_SMOOTHING: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    MEAN: tl.constexpr,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_row_stride
    grad_row = grad_ptr + row * grad_row_stride
    target = tl.load(target_ptr + row * target_stride).to(tl.int64)
    cols = tl.arange(0, CHUNK)

    if target == ignore_index:
        tl.store(row_loss_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, n_vocab, CHUNK):
                offs = start + cols
                tl.store(grad_row + offs, tl.zeros([CHUNK], tl.float32).to(grad_ptr.dtype.element_ty), mask=offs < n_vocab)
    else:
        # Pass 1: online log-sum-exp (and the plain sum of logits that label smoothing needs).
        running_max = float("-inf")
        running_sum = 0.0
        logit_sum = 0.0
        for start in range(0, n_vocab, CHUNK):
            offs = start + cols
            in_vocab = offs < n_vocab
            x = tl.load(logits_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
            if HAS_SMOOTHING:
                logit_sum += tl.sum(tl.where(in_vocab, x, 0.0), axis=0)
        lse = running_max + tl.log(running_sum)

        target_in_vocab = (target >= 0) & (target < n_vocab)
        target_logit = tl.load(logits_row + target, mask=target_in_vocab, other=float("nan")).to(tl.float32)
        if HAS_SMOOTHING:
            # (1 - s) * (lse - x_t) + s * mean_j(lse - x_j)
            loss = lse - (1.0 - label_smoothing) * target_logit - label_smoothing * (logit_sum / n_vocab)
        else:
            loss = lse - target_logit
        tl.store(row_loss_ptr + row, loss)

        if WRITE_GRAD:
            # Pass 2: d loss / d x_j = softmax_j - (1 - s) [j == t] - s / V, times the reduction's scale.
            scale = 1.0
            if MEAN:
                scale = 1.0 / tl.load(n_valid_ptr).to(tl.float32)
            for start in range(0, n_vocab, CHUNK):
                offs = start + cols
                in_vocab = offs < n_vocab
                x = tl.load(logits_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
                grad = tl.exp(x - lse)
                if HAS_SMOOTHING:
                    grad = grad - label_smoothing / n_vocab
                grad = tl.where(offs == target, grad - (1.0 - label_smoothing), grad) * scale
                tl.store(grad_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_vocab)


@triton.jit
def _scale_rows_kernel(grad_ptr, grad_row_stride, factor_ptr, factor_stride, n_cols, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    factor = tl.load(factor_ptr + row * factor_stride).to(tl.float32)
    # The common case is d(loss)/d(loss) = 1: skip on the device instead of asking the host.
    if factor != 1.0:
        grad_row = grad_ptr + row * grad_row_stride
        cols = tl.arange(0, CHUNK)
        for start in range(0, n_cols, CHUNK):
            offs = start + cols
            in_row = offs < n_cols
            g = tl.load(grad_row + offs, mask=in_row).to(tl.float32)
            tl.store(grad_row + offs, (g * factor).to(grad_ptr.dtype.element_ty), mask=in_row)


def _launch_config(n_vocab: int, writes: bool) -> tuple[int, int]:
    """(chunk, warps) of a walk that only reads the logits, or also writes a row of the same length."""
    if writes:
        return min(max(1, MAX_FUSED_BLOCK // 2), next_power_of_2(n_vocab)), 8
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
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    grad = torch.empty((n_rows, n_vocab), dtype=logits.dtype, device=logits.device) if write_grad else None
    n_valid = (target != ignore_index).sum() if reduction == "mean" else None

    if n_rows > 0:
        chunk, num_warps = _launch_config(n_vocab, write_grad)
        _cross_entropy_kernel[(n_rows,)](
            logits, logits.stride(0),
            target, target.stride(0),
            row_loss,
            grad if write_grad else row_loss, grad.stride(0) if write_grad else 0,
            n_valid if n_valid is not None else row_loss,
            n_vocab, ignore_index, float(label_smoothing),
            HAS_SMOOTHING=label_smoothing > 0.0,
            WRITE_GRAD=write_grad,
            MEAN=reduction == "mean",
            CHUNK=chunk,
            num_warps=num_warps,
        )

    if reduction == "none":
        loss = row_loss
    elif reduction == "sum":
        loss = row_loss.sum()
    else:
        loss = row_loss.sum() / n_valid  # no valid row: 0 / 0 = NaN, as torch gives
    return loss.to(logits.dtype), grad


def _scale_rows_(grad: torch.Tensor, factor: torch.Tensor) -> None:
    """grad[r, :] *= factor[r] (or the scalar factor) in place."""
    n_rows, n_cols = grad.shape
    if n_rows == 0:
        return
    factor_stride = factor.stride(0) if factor.dim() == 1 else 0
    chunk, num_warps = _launch_config(n_cols, writes=True)
    _scale_rows_kernel[(n_rows,)](grad, grad.stride(0), factor, factor_stride, n_cols, CHUNK=chunk, num_warps=num_warps)


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
        _scale_rows_(grad, grad_loss.to(torch.float32))
        return grad, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of `logits` [rows, vocab] against class indices `target` [rows], like
    `torch.nn.functional.cross_entropy`, computed in float32 without a float32 copy of the logits.

    Rows whose target is `ignore_index` contribute no loss and no gradient; "mean" divides by the
    number of the other rows. The loss has the logits' dtype.
    """
    _check_inputs(logits, target, ignore_index, reduction, label_smoothing)
    if needs_autograd(logits):
        return CrossEntropyFunction.apply(logits, target, ignore_index, reduction, label_smoothing)
    loss, _ = _cross_entropy_forward(logits, target, ignore_index, reduction, label_smoothing, write_grad=False)
    return loss
