"""Input checks shared by the kernels: each raises an error that names the offending argument.

Kept to attribute reads and comparisons, since they run on every call, including at decode size.
"""

from __future__ import annotations

import torch

from fuselab.device import triton_interpreted

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Compiled kernels read CUDA memory; the interpreter reads CPU tensors. Decided once, at import
# (reading the environment on every launch costs a decode step microseconds).
INTERPRETED = triton_interpreted()
KERNEL_DEVICE_TYPE = "cpu" if INTERPRETED else "cuda"


def check_float_tensor(name: str, t: object) -> None:
    """A float32/bfloat16/float16 tensor on the device the kernels run on."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.device.type != KERNEL_DEVICE_TYPE:
        raise ValueError(f"{name} must be a {KERNEL_DEVICE_TYPE} tensor for the Triton kernels, got one on {t.device}")


def check_at_least_1d(name: str, t: torch.Tensor) -> None:
    if t.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d tensor")


def check_like(name: str, t: object, ref_name: str, ref: torch.Tensor) -> None:
    """`t` must be a tensor of the same shape, dtype and device as `ref`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}")
    if t.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}")


def check_row_vector(name: str, t: object, x_name: str, x: torch.Tensor) -> None:
    """A per-column parameter (weight, bias): 1-D, as long as the last dim of `x`, on the same device."""
    check_float_tensor(name, t)
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}")
    if t.dim() != 1 or t.shape[0] != x.shape[-1]:
        raise ValueError(f"{name} must have shape ({x.shape[-1]},) to match the last dim of {x_name}, got {tuple(t.shape)}")


def check_flag(name: str, value: object) -> None:
    """A real bool: a string such as "no" or a tensor would otherwise be taken by its truthiness."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_eps(eps: object) -> None:
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels index rows as `row * n_cols`; a strided view is copied once here, explicitly."""
    return t if t.is_contiguous() else t.contiguous()


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether to go through the autograd.Function; skipping it saves host time in inference."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
