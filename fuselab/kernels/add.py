"""Elementwise a + b: the smallest complete kernel, a grid of fixed-size blocks with a masked tail."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.launch import cdiv
from fuselab.kernels._common.validate import check_float_tensor, check_like, contiguous, needs_autograd

# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _add_kernel(A, B, OUT, n_elements, BLOCK: tl.constexpr):
    # int64 offsets: a tensor of more than 2³¹ elements is within reach of an H200's memory.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements  # the last block runs past the end
    a = tl.load(A + offs, mask=mask).to(tl.float32)
    b = tl.load(B + offs, mask=mask).to(tl.float32)
    tl.store(OUT + offs, (a + b).to(OUT.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host launcher
# --------------------------------------------------------------------------------------------

# 4096 elements over 8 warps: 16 per thread, whole 16-byte vector loads in every dtype.
_BLOCK = 4096
_NUM_WARPS = 8


@functools.lru_cache(maxsize=4096)
def _grid(n_elements: int) -> tuple[int]:
    return (cdiv(n_elements, _BLOCK),)


def add_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b for contiguous tensors of one shape and dtype."""
    out = torch.empty_like(a)
    n_elements = a.numel()
    if n_elements:
        launch(_add_kernel, _grid(n_elements), a, b, out, n_elements, BLOCK=_BLOCK, num_warps=_NUM_WARPS)
    return out


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


class AddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        return add_forward(a, b)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b for float tensors of the same shape, dtype and device (no broadcasting), summed in fp32."""
    check_float_tensor("a", a)
    check_like("b", b, "a", a)
    a, b = contiguous(a), contiguous(b)
    if needs_autograd(a, b):
        return AddFunction.apply(a, b)
    return add_forward(a, b)
