"""Input checks shared by the kernels: each raises an error that names the offending argument.

Kept to attribute reads and comparisons, since they run on every call, including at decode size: each
first tests the common case in one expression (no torch.device objects where a flag does), and only
when that fails goes through the checks one by one to name what is wrong. The `..._ok` predicates are
that first test alone, for an op that tests all of its inputs in one pass: True only where the checks
they stand for would pass, so an op runs those checks (for their errors) only when a predicate says no.
"""

from __future__ import annotations

import operator

import torch

from fuselab.device import triton_interpreted

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Compiled kernels read CUDA memory; the interpreter reads CPU tensors. Decided once, at import
# (reading the environment on every launch costs a decode step microseconds).
INTERPRETED = triton_interpreted()
KERNEL_DEVICE_TYPE = "cpu" if INTERPRETED else "cuda"
# The tensor flag that says a tensor is on that device: cheaper to read than `t.device.type`.
_ON_KERNEL_DEVICE = "is_cpu" if INTERPRETED else "is_cuda"
on_kernel_device = operator.attrgetter(_ON_KERNEL_DEVICE)
_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled


def check_float_tensor(name: str, t: object) -> None:
    """A float32/bfloat16/float16 tensor on the device the kernels run on."""
    if isinstance(t, torch.Tensor) and t.dtype in FLOAT_DTYPES and getattr(t, _ON_KERNEL_DEVICE):
        return
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
    if isinstance(t, torch.Tensor) and t.dtype == ref.dtype and t.shape == ref.shape and t.device == ref.device:
        return
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
    if (isinstance(t, torch.Tensor) and t.dtype in FLOAT_DTYPES and getattr(t, _ON_KERNEL_DEVICE) and t.dim() == 1
            and t.shape[0] == x.shape[-1] and t.device == x.device):
        return
    check_float_tensor(name, t)
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}")
    if t.dim() != 1 or t.shape[0] != x.shape[-1]:
        raise ValueError(f"{name} must have shape ({x.shape[-1]},) to match the last dim of {x_name}, got {tuple(t.shape)}")


def float_tensor_ok(t: object) -> bool:
    """`check_float_tensor` would pass."""
    return isinstance(t, _Tensor) and t.dtype in FLOAT_DTYPES and getattr(t, _ON_KERNEL_DEVICE)


def like_ok(t: object, ref: torch.Tensor) -> bool:
    """`check_like(..., t, ..., ref)` would pass."""
    return isinstance(t, _Tensor) and t.dtype is ref.dtype and t.shape == ref.shape and t.device == ref.device


def rows_and_vector_ok(x: object, v: object) -> bool:
    """`check_float_tensor` and `check_at_least_1d` of x and `check_row_vector` of v against x would all pass."""
    if not (isinstance(x, _Tensor) and isinstance(v, _Tensor)):
        return False
    shape, v_shape = x.shape, v.shape
    return (x.dtype in FLOAT_DTYPES and v.dtype in FLOAT_DTYPES and getattr(x, _ON_KERNEL_DEVICE) and len(shape) > 0
            and len(v_shape) == 1 and v_shape[0] == shape[-1] and v.device == x.device)


def counters_ok(counters: object, n: int, device: torch.device) -> bool:
    """`check_counters` would pass."""
    return (isinstance(counters, _Tensor) and counters.dtype is torch.int32 and counters.numel() >= n
            and counters.device == device and counters.is_contiguous())


def check_counters(counters: object, n: int, device: torch.device) -> None:
    """A caller's ticket counters (the kernels whose last program merges): a contiguous int32 buffer of at
    least n elements on the inputs' device. That they are all zero is the caller's part (a check would sync)."""
    if not isinstance(counters, torch.Tensor):
        raise TypeError(f"counters must be a torch.Tensor or None, got {type(counters).__name__}")
    if counters.dtype != torch.int32:
        raise TypeError(f"counters must be int32, got {counters.dtype}")
    if counters.device != device:
        raise ValueError(f"counters is on {counters.device} but the inputs are on {device}")
    if not counters.is_contiguous():
        raise ValueError(f"counters must be contiguous, got strides {counters.stride()}")
    if counters.numel() < n:
        raise ValueError(f"counters has {counters.numel()} elements but this call needs at least {n}")


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
    if not _grad_enabled():
        return False
    for t in tensors:  # a loop, not any() over a generator: this runs on every call
        if t is not None and t.requires_grad:
            return True
    return False
