"""What RoPE's launchers take: the inputs' checks, in one pass for the hot path and one by one for the
error that names what is wrong, and whether q and k share memory (in-place rotation needs them apart).
rope.py and rope_store.py share them."""

from __future__ import annotations

import torch

from fuselab.kernels._common.validate import FLOAT_DTYPES, check_float_tensor, on_kernel_device

LAYOUTS = ("rotate_half", "interleaved")


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, past the last byte] of the elements a tensor views."""
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True) if size)
    return start, start + (last + 1) * t.element_size()


def _one_token_apart(q: torch.Tensor, k: torch.Tensor) -> bool:
    """tokens_apart for one token of the decode layout: each tensor one dense run."""
    q_shape, k_shape, qp, kp = q.shape, k.shape, q.data_ptr(), k.data_ptr()
    return (qp + q_shape[-2] * q_shape[-1] * q.element_size() <= kp
            or kp + k_shape[-2] * k_shape[-1] * k.element_size() <= qp)


def tokens_apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b share no element, for tensors of the decode layout ([..., heads, head_dim], each
    token's heads one dense run, tokens a.stride(-3) apart): their extents are apart, or, as views of one
    projection, they step by one token stride and their runs lie apart within it. Anything else is taken
    as sharing."""
    if a.numel() == 0 or b.numel() == 0:
        return True
    (a_start, a_end), (b_start, b_end) = _extent(a), _extent(b)
    if a_end <= b_start or b_end <= a_start:
        return True
    size, a_stride, b_stride, a_shape, b_shape = a.element_size(), a.stride(), b.stride(), a.shape, b.shape
    if (size != b.element_size() or a.dim() != b.dim() or a_stride[-3] != b_stride[-3] or a_stride[-1] != 1
            or b_stride[-1] != 1 or a_stride[-2] != a_shape[-1] or b_stride[-2] != b_shape[-1]):
        return False
    # [batch, seq, ...]: one run of tokens only if each batch starts seq tokens after the last.
    if a.dim() == 4 and (a_stride[0] != a_shape[1] * a_stride[1] or b_stride[0] != b_shape[1] * b_stride[1]):
        return False
    a_run, b_run = a_shape[-2] * a_shape[-1] * size, b_shape[-2] * b_shape[-1] * size
    (first, first_run), (second, second_run) = sorted(((a_start, a_run), (b_start, b_run)))
    return first + first_run <= second and second + second_run <= first + a_stride[-3] * size


# Integer position dtypes the one-pass check takes; any other integer dtype goes through the full checks.
_POSITION_DTYPES = (torch.int64, torch.int32)


def _inputs_ok(q: object, k: object, positions: object, cos_sin: object, layout: object) -> bool:
    """`_check_inputs` would pass: its checks in one pass over the attributes, each read once."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(positions, torch.Tensor)
            and isinstance(cos_sin, torch.Tensor)):
        return False
    q_shape, k_shape, positions_shape, cos_sin_shape = q.shape, k.shape, positions.shape, cos_sin.shape
    dims = len(q_shape)
    device = q.device
    leading = q_shape[:-2]
    return (layout in LAYOUTS and q.dtype in FLOAT_DTYPES and k.dtype in FLOAT_DTYPES
            and cos_sin.dtype in FLOAT_DTYPES and on_kernel_device(q) and (dims == 3 or dims == 4)
            and len(k_shape) == dims and k_shape[:-2] == leading and k_shape[-1] == q_shape[-1]
            and q.stride()[-1] == 1 and k.stride()[-1] == 1 and positions.dtype in _POSITION_DTYPES
            and (positions_shape == leading or (dims == 4 and positions_shape == leading[1:]))
            and len(cos_sin_shape) == 2 and cos_sin_shape[1] % 2 == 0 and 0 < cos_sin_shape[1] <= q_shape[-1]
            and cos_sin.stride()[1] == 1
            and k.device == device and positions.device == device and cos_sin.device == device)


_Tensor = torch.Tensor


def _decode_layout_ok(q: object, k: object, positions: object, cos_sin: object, layout: object) -> bool:
    """`_inputs_ok`, and the inputs have the layout _rope_decode_kernel takes, a decode step's: q and k
    [tokens, heads, head_dim] (or [batch, seq, ...] whose batches are seq tokens apart) with heads head_dim
    apart (views of one projection are), one position per token, contiguous (for [batch, seq] inputs:
    [batch, seq], or [seq] with one batch), a contiguous cos/sin table. One pass."""
    if not (isinstance(q, _Tensor) and isinstance(k, _Tensor) and isinstance(positions, _Tensor)
            and isinstance(cos_sin, _Tensor)):
        return False
    q_shape, k_shape, positions_shape, cos_sin_shape = q.shape, k.shape, positions.shape, cos_sin.shape
    dims = len(q_shape)
    if len(k_shape) != dims or not (dims == 3 or dims == 4):
        return False
    q_stride, k_stride = q.stride(), k.stride()
    leading, head_dim = q_shape[:-2], q_shape[-1]
    if dims == 3:
        positions_ok = positions_shape == leading
    else:
        seq = q_shape[1]
        positions_ok = ((positions_shape == leading or (q_shape[0] == 1 and positions_shape == leading[1:]))
                        and q_stride[0] == seq * q_stride[1] and k_stride[0] == seq * k_stride[1])
    device = q.get_device()
    return (positions_ok and layout in LAYOUTS and q.dtype in FLOAT_DTYPES and k.dtype in FLOAT_DTYPES
            and cos_sin.dtype in FLOAT_DTYPES and positions.dtype in _POSITION_DTYPES and on_kernel_device(q)
            and k_shape[:-2] == leading and k_shape[-1] == head_dim
            and q_stride[-1] == 1 and k_stride[-1] == 1 and q_stride[-2] == head_dim and k_stride[-2] == head_dim
            and positions.is_contiguous() and cos_sin.is_contiguous() and len(cos_sin_shape) == 2
            and cos_sin_shape[1] % 2 == 0 and 0 < cos_sin_shape[1] <= head_dim
            and on_kernel_device(k) and on_kernel_device(positions) and on_kernel_device(cos_sin)
            and k.get_device() == device and positions.get_device() == device and cos_sin.get_device() == device)


def _check_inputs(q, k, positions, cos_sin, layout) -> None:
    check_float_tensor("q", q)
    check_float_tensor("k", k)
    check_float_tensor("cos_sin", cos_sin)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [tokens, heads, head_dim] or [batch, seq, heads, head_dim], got shape {tuple(q.shape)}")
    if k.dim() != q.dim() or k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must match q {tuple(q.shape)} in every dim but the heads, got shape {tuple(k.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must have a contiguous last (head_dim) dimension; other strides may be anything")
    if not isinstance(positions, torch.Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
        raise TypeError(f"positions must hold integers, got {positions.dtype}")
    leading = q.shape[:-2]
    if positions.shape != leading and not (q.dim() == 4 and positions.shape == leading[1:]):
        raise ValueError(f"positions must have shape {tuple(leading)} (or [seq] for a 4-D q), got {tuple(positions.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] % 2 or not 0 < cos_sin.shape[1] <= q.shape[-1]:
        raise ValueError(
            f"cos_sin must be [max_pos, rotary_dim] with an even rotary_dim <= head_dim {q.shape[-1]}, got shape {tuple(cos_sin.shape)}"
        )
    if cos_sin.stride(1) != 1:
        raise ValueError("cos_sin must have a contiguous last dimension")
    for name, t in (("k", k), ("positions", positions), ("cos_sin", cos_sin)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
