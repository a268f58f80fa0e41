"""The SwiGLU gate of a Llama-style MLP: silu(gate) · up, in one read of each input and one write.

`swiglu(gate, up)` takes the two projections as separate tensors (Hugging Face's LlamaMLP);
`silu_and_mul(x)` takes them side by side in the last dim, [gate | up] (vLLM's merged gate_up
projection), and reads both halves in place without splitting x, or with `pairs=True` (gate, up) pairs
side by side, [g0, u0, g1, u1, ...]; `rms_silu_and_mul(x, h)` also takes the RMSNorm factor of the h that x
was projected from, when the norm's weight lives in the projection.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.launch import cdiv, next_power_of_2, row_and_columns, row_block_grid, use_pdl
from fuselab.kernels._common.validate import (
    check_at_least_1d,
    check_eps,
    check_float_tensor,
    check_like,
    contiguous,
    float_tensor_ok,
    like_ok,
    needs_autograd,
)

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _swiglu_forward_kernel(G, U, Y, n_cols, in_row_stride, up_offset, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    row, cols = row_and_columns(n_cols, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * in_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + up_offset + row * in_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_flat_forward_kernel(G, U, Y, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # Separate, contiguous gate and up: one flat int32 index (n < 2³¹), programs in memory order.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_pairs_kernel(X, Y, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    # (gate, up) pairs side by side: 2·BLOCK contiguous inputs make BLOCK outputs; int32 offsets (2n < 2³¹).
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    start = tl.program_id(0) * BLOCK
    ins = 2 * start + tl.arange(0, 2 * BLOCK)
    v = tl.load(X + ins, mask=ins < 2 * n, other=0.0).to(tl.float32)
    g, u = tl.split(tl.reshape(v, [BLOCK, 2]))
    offs = start + tl.arange(0, BLOCK)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=offs < n)


@triton.jit
def _rms_silu_and_mul_kernel(X, H, Y, n_cols, h_cols, eps, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                             USE_PDL: tl.constexpr):
    """A block of one row of [gate | up], both scaled by that row of h's 1 / rms first."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    row, cols = row_and_columns(n_cols, BLOCK)
    mask = cols < n_cols
    g = tl.load(X + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # Every program of the row sums h² itself: h is one row, read from L2, next to a separate norm's launch.
    sq = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, h_cols, BLOCK_H):
        h_offs = start + tl.arange(0, BLOCK_H)
        h = tl.load(H + row * h_cols + h_offs, mask=h_offs < h_cols, other=0.0).to(tl.float32)
        sq += h * h
    r = tl.rsqrt(tl.sum(sq, axis=0) / h_cols + eps)
    g *= r
    y = g * tl.sigmoid(g) * (u * r)
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(DY, G, U, DG, DU, n_cols, in_row_stride, up_offset, BLOCK: tl.constexpr):
    row, cols = row_and_columns(n_cols, BLOCK)
    mask = cols < n_cols
    in_offs = row * in_row_stride + cols
    dy = tl.load(DY + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + in_offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + up_offset + in_offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    tl.store(DG + in_offs, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + up_offset + in_offs, du.to(DU.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_flat_backward_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DG + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * g * s).to(DU.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------

# Separate contiguous gate and up are one flat array: 2048 elements a program, programs in memory
# order, int32 offsets, faster than a (rows, column blocks) grid (docs/tuning/swiglu-constants.md).
# [gate | up] halves of one tensor (silu_and_mul) take the same 2048-element programs, numbered in
# memory order, each within one row.
_FLAT_BLOCK = 2048
_MAX_BLOCK = 2048
_NUM_WARPS = 8


def _flat(n: int, in_row_stride: int, n_cols: int, up_offset: int) -> bool:
    """Whether gate, up and out are one flat array each (rows back to back) that int32 offsets reach."""
    return in_row_stride == n_cols and up_offset == 0 and n < 2**31


def swiglu_forward(
    gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, in_row_stride: int, up_offset: int = 0
) -> torch.Tensor:
    """silu(gate) · up into `out`. Rows of gate and up are `in_row_stride` elements apart; up's
    elements start `up_offset` after `up`'s data pointer, which lets one tensor hold [gate | up]."""
    n = out.numel()
    if n == 0:
        return out
    n_cols = out.shape[-1]
    pdl = use_pdl(out.device)
    if _flat(n, in_row_stride, n_cols, up_offset):
        launch(_swiglu_flat_forward_kernel, (cdiv(n, _FLAT_BLOCK),),
            gate, up, out, n, BLOCK=_FLAT_BLOCK, USE_PDL=pdl, num_warps=_NUM_WARPS, launch_pdl=pdl)
        return out
    grid, block = row_block_grid(n // n_cols, n_cols, _MAX_BLOCK)
    launch(_swiglu_forward_kernel, grid, gate, up, out, n_cols, in_row_stride, up_offset, BLOCK=block, USE_PDL=pdl,
           num_warps=_NUM_WARPS, launch_pdl=pdl)
    return out


def swiglu_backward(
    dy: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    dgate: torch.Tensor,
    dup: torch.Tensor,
    in_row_stride: int,
    up_offset: int = 0,
) -> None:
    """Writes the gradients of gate and up into `dgate` and `dup`, laid out like gate and up."""
    if dy.numel() == 0:
        return
    n_cols = dy.shape[-1]
    if _flat(dy.numel(), in_row_stride, n_cols, up_offset):
        launch(_swiglu_flat_backward_kernel, (cdiv(dy.numel(), _FLAT_BLOCK),),
            dy, gate, up, dgate, dup, dy.numel(), BLOCK=_FLAT_BLOCK, num_warps=_NUM_WARPS)
        return
    grid, block = row_block_grid(dy.numel() // n_cols, n_cols, _MAX_BLOCK)
    launch(_swiglu_backward_kernel, grid,
        dy, gate, up, dgate, dup, n_cols, in_row_stride, up_offset, BLOCK=block, num_warps=_NUM_WARPS
    )


def silu_and_mul_forward(x: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    width = shape[-1]
    half = width // 2
    out = x.new_empty(*shape[:-1], half)
    # The kernel reads the up half in place: same rows, `half` elements further along.
    return swiglu_forward(x, x, out, width, up_offset=half)


def silu_and_mul_pairs_forward(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    n = out.numel()
    if n == 0:
        return out
    pdl = use_pdl(out.device)
    launch(_silu_and_mul_pairs_kernel, (cdiv(n, _FLAT_BLOCK),), x, out, n, BLOCK=_FLAT_BLOCK, USE_PDL=pdl,
           num_warps=_NUM_WARPS, launch_pdl=pdl)
    return out


def rms_silu_and_mul_forward(x: torch.Tensor, h: torch.Tensor, eps: float) -> torch.Tensor:
    half = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], half)
    if out.numel() == 0:
        return out
    h_cols = h.shape[-1]
    grid, block = row_block_grid(out.numel() // half, half, _MAX_BLOCK)
    pdl = use_pdl(out.device)
    launch(_rms_silu_and_mul_kernel, grid, x, h, out, half, h_cols, eps, BLOCK=block,
           BLOCK_H=min(_MAX_BLOCK, next_power_of_2(h_cols)), USE_PDL=pdl, num_warps=_NUM_WARPS, launch_pdl=pdl)
    return out


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up, torch.empty_like(gate), gate.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        swiglu_backward(contiguous(dy), gate, up, dgate, dup, gate.shape[-1])
        return dgate, dup


class SiluAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return silu_and_mul_forward(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        half = x.shape[-1] // 2
        dx = torch.empty_like(x)
        swiglu_backward(contiguous(dy), x, x, dx, dx, x.shape[-1], up_offset=half)
        return dx


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, elementwise, computed in fp32 and returned in the inputs' dtype."""
    if not (float_tensor_ok(gate) and like_ok(up, gate) and gate.dim() > 0):
        check_float_tensor("gate", gate)  # the checks one by one, which name what is wrong
        check_at_least_1d("gate", gate)
        check_like("up", up, "gate", gate)
    gate, up = contiguous(gate), contiguous(up)
    if needs_autograd(gate, up):
        return SwiGLUFunction.apply(gate, up)
    return swiglu_forward(gate, up, torch.empty_like(gate), gate.shape[-1])


def silu_and_mul(x: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """For x = [gate | up] along the last dim (2H wide), returns silu(gate) · up (H wide); with `pairs`, x's
    last dim holds (gate, up) pairs, [g0, u0, g1, u1, ...] (a projection whose weight rows are so paired)."""
    if not (float_tensor_ok(x) and x.dim() > 0 and x.shape[-1] % 2 == 0 and type(pairs) is bool):
        check_float_tensor("x", x)  # the checks one by one, which name what is wrong
        check_at_least_1d("x", x)
        if x.shape[-1] % 2:
            raise ValueError(f"x's last dim holds [gate | up] and must be even, got {x.shape[-1]}")
        raise TypeError(f"pairs must be a bool, got {type(pairs).__name__}")
    x = contiguous(x)
    if pairs:
        if needs_autograd(x):  # inference-only kernel: the differentiable torch form
            gate, up = x.unflatten(-1, (-1, 2)).unbind(-1)
            return torch.nn.functional.silu(gate) * up
        return silu_and_mul_pairs_forward(x)
    if needs_autograd(x):
        return SiluAndMulFunction.apply(x)
    return silu_and_mul_forward(x)


def rms_silu_and_mul(x: torch.Tensor, h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """silu(gate / rms(h)) · (up / rms(h)) for x = [gate | up] along the last dim, rms(h) = sqrt(mean(h²) + eps)
    over each row of h: the SwiGLU of a gate/up projection of RMSNorm(h) whose norm weight was folded into
    the projection's weight (x = h · (W · diag(g))ᵀ), the norm's factor applied here instead of in a kernel
    of its own. For inference (no autograd)."""
    if not (float_tensor_ok(x) and x.dim() > 0 and x.shape[-1] % 2 == 0 and float_tensor_ok(h)
            and h.dtype is x.dtype and h.device == x.device and h.dim() == x.dim() and h.shape[:-1] == x.shape[:-1]
            and h.shape[-1] > 0 and type(eps) is float and eps >= 0):
        check_float_tensor("x", x)  # the checks one by one, which name what is wrong
        check_at_least_1d("x", x)
        if x.shape[-1] % 2:
            raise ValueError(f"x's last dim holds [gate | up] and must be even, got {x.shape[-1]}")
        check_float_tensor("h", h)
        if h.dtype != x.dtype or h.device != x.device:
            raise TypeError(f"h must be {x.dtype} on {x.device} like x, got {h.dtype} on {h.device}")
        if h.dim() != x.dim() or h.shape[:-1] != x.shape[:-1] or h.shape[-1] == 0:
            raise ValueError(f"h must have x's rows {tuple(x.shape[:-1])} and a non-empty last dim, "
                             f"got shape {tuple(h.shape)}")
        check_eps(eps)
        eps = float(eps)
    if needs_autograd(x, h):
        raise ValueError("rms_silu_and_mul is for inference: x and h must not require grad")
    return rms_silu_and_mul_forward(contiguous(x), contiguous(h), eps)
