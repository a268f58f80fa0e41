"""A decode step's embedding lookup, with the choice of each row's token, in one launch.

A CUDA-graph decode step takes some of its tokens from the device (the step before wrote them to
`last_tokens`), so that nothing waits for a copy to the host: torch.where(input_ids >= 0, input_ids,
last_tokens[prev_rows]) and then F.embedding is 4-5 small kernels before the first layer. Here each program
picks its row's token and copies a block of that token's row of the table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import prepare
from fuselab.kernels._common.launch import cdiv, next_power_of_2, use_pdl
from fuselab.kernels._common.validate import (
    FLOAT_DTYPES,
    check_float_tensor,
    on_kernel_device,
)

# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _embedding_kernel(
    W, IDS, LAST, PREV, OUT, vocab, hidden, n_last, stride_w, stride_ids, stride_last, stride_prev,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (row, block) copies columns [block · BLOCK, (block + 1) · BLOCK) of its token's row of W.
    # Every index is masked, not trusted: a prev_rows value outside last_tokens reads nothing, and a
    # token outside [0, vocab) reads nothing and gives a row of zeros.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output (the tokens)
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    token = tl.load(IDS + row * stride_ids).to(tl.int64)
    from_last = token < 0  # the token is on the device, at last_tokens[prev_rows[row]]
    prev = tl.load(PREV + row * stride_prev, mask=from_last, other=-1).to(tl.int64)
    prev_ok = (prev >= 0) & (prev < n_last)
    last = tl.load(LAST + prev * stride_last, mask=prev_ok, other=-1).to(tl.int64)
    token = tl.where(from_last, last, token)
    # The token splat over the columns first (free when compiled): Triton's interpreter broadcasts a scalar
    # comparison into a mask of integers, which its loads refuse.
    tokens = tl.broadcast_to(token, [BLOCK])
    col_ok = cols < hidden
    x = tl.load(W + tokens * stride_w + cols, mask=(tokens >= 0) & (tokens < vocab) & col_ok, other=0.0)
    tl.store(OUT + row * hidden + cols, x, mask=col_ok)


# --------------------------------------------------------------------------------------------
# Host launcher
# --------------------------------------------------------------------------------------------

# Columns per program: a Llama 3 8B row (4096) is 4 programs, 2 KB of bf16 each.
MAX_BLOCK = 1024


def embedding_launch(weight: torch.Tensor, input_ids: torch.Tensor, last_tokens: torch.Tensor,
                     prev_rows: torch.Tensor) -> torch.Tensor:
    """The kernel on checked inputs with rows >= 1 and hidden >= 1: h [rows, hidden] in weight's dtype."""
    vocab, hidden = weight.shape
    rows = input_ids.shape[0]
    out = weight.new_empty(rows, hidden)
    block = min(MAX_BLOCK, next_power_of_2(hidden))
    launcher = _embedding_launcher(block, use_pdl(weight.device))
    launcher((rows, cdiv(hidden, block)), weight, input_ids, last_tokens, prev_rows, out, vocab, hidden,
             last_tokens.shape[0], weight.stride()[0], input_ids.stride()[0], last_tokens.stride()[0],
             prev_rows.stride()[0])
    return out


@functools.cache
def _embedding_launcher(block: int, pdl: bool) -> Callable[..., None]:
    """The kernel with its compile-time arguments and launch options, once per block size."""
    # 8 elements a thread at 1024 columns (16-byte loads of bf16), fewer warps for narrower rows.
    return prepare(_embedding_kernel, BLOCK=block, USE_PDL=pdl, num_warps=max(1, min(4, block // 256)),
                   launch_pdl=pdl)


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------

_ID_DTYPES = (torch.int32, torch.int64)
_Tensor = torch.Tensor


def _inputs_ok(weight: object, input_ids: object, last_tokens: object, prev_rows: object) -> bool:
    """`_check_inputs` would pass: its checks in one pass over the attributes."""
    if not (isinstance(weight, _Tensor) and isinstance(input_ids, _Tensor) and isinstance(last_tokens, _Tensor)
            and isinstance(prev_rows, _Tensor)):
        return False
    w_shape, ids_shape, device = weight.shape, input_ids.shape, weight.device
    return (weight.dtype in FLOAT_DTYPES and on_kernel_device(weight) and len(w_shape) == 2
            and (weight.stride()[1] == 1 or w_shape[1] <= 1) and input_ids.dtype in _ID_DTYPES
            and last_tokens.dtype in _ID_DTYPES and prev_rows.dtype in _ID_DTYPES and len(ids_shape) == 1
            and prev_rows.shape == ids_shape and last_tokens.dim() == 1 and input_ids.device == device
            and last_tokens.device == device and prev_rows.device == device)


def _check_inputs(weight: object, input_ids: object, last_tokens: object, prev_rows: object) -> None:
    """The checks one by one, each naming what is wrong."""
    check_float_tensor("weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [vocab, hidden], got shape {tuple(weight.shape)}")
    if weight.stride()[1] != 1 and weight.shape[1] > 1:
        raise ValueError(f"weight's rows must be contiguous (stride(1) == 1), got strides {weight.stride()}")
    for name, t in (("input_ids", input_ids), ("last_tokens", last_tokens), ("prev_rows", prev_rows)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _ID_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.device != weight.device:
            raise ValueError(f"{name} is on {t.device} but weight is on {weight.device}")
    if prev_rows.shape != input_ids.shape:
        raise ValueError(f"prev_rows must have input_ids' length {input_ids.shape[0]}, got {prev_rows.shape[0]}")


def decode_embedding(weight: torch.Tensor, input_ids: torch.Tensor, last_tokens: torch.Tensor,
                     prev_rows: torch.Tensor) -> torch.Tensor:
    """The embeddings of a decode step's tokens: h [rows, hidden] in weight's dtype, h[i] = weight[t_i], where
    t_i = input_ids[i] if input_ids[i] >= 0, else last_tokens[prev_rows[i]] (a token the step before left on
    the device). `F.embedding(torch.where(input_ids >= 0, input_ids, last_tokens[prev_rows]), weight)` in one
    launch.

    weight [vocab, hidden] float32/bfloat16/float16 with contiguous rows (any row stride); input_ids and
    prev_rows [rows], last_tokens [n]: int32 or int64, on weight's device. prev_rows[i] is read only where
    input_ids[i] < 0. Nothing is read back to the host, so a CUDA graph can capture the call, and no token is
    validated there: a token outside [0, vocab), or a prev_rows value outside [0, n), gives a row of zeros
    (the kernel never reads out of bounds). For inference: the result carries no gradient.
    """
    if not _inputs_ok(weight, input_ids, last_tokens, prev_rows):
        _check_inputs(weight, input_ids, last_tokens, prev_rows)
    rows, hidden = input_ids.shape[0], weight.shape[1]
    if rows == 0 or hidden == 0:
        return weight.new_empty(rows, hidden)
    return embedding_launch(weight, input_ids, last_tokens, prev_rows)
