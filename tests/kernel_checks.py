"""Comparison helpers for the kernel tests: results against a float64 reference, tolerances per dtype."""

from __future__ import annotations

import importlib

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# fp32 kernels accumulate in a different order than the float64 reference; half precision is
# bounded by the rounding of the stored result (bf16 keeps 8 mantissa bits, fp16 11).
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
    torch.float16: dict(rtol=1e-2, atol=2e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """`actual` (any dtype) against a float64 `expected`, at the tolerance of `dtype` times `scale`."""
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=tol["rtol"] * scale, atol=tol["atol"] * scale, equal_nan=True
    )


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A float64 copy that records gradients, for the reference side of a backward check."""
    return t.detach().double().requires_grad_(True)


def kernel_module(name: str):
    """The module `fuselab.kernels.<name>` (the package attribute of that name is the op function)."""
    return importlib.import_module(f"fuselab.kernels.{name}")


def lower_block_cap(monkeypatch, name: str, cap: int) -> None:
    """Make the op stream rows longer than `cap` elements, so the looped kernels run at small widths."""
    monkeypatch.setattr(kernel_module(name), "MAX_FUSED_BLOCK", cap)
