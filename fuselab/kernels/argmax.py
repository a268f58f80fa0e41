"""Argmax over the last dim of a [rows, cols] tensor, for greedy decoding, in one launch.

torch.argmax at decode size (one row of a 128K vocabulary) reduces the whole row in a single
block, so one SM reads the 256 KB of logits while the rest of the GPU idles. Here the kernel cuts
every row into chunks of CHUNK columns, one program per (row, chunk), each writing its chunk's
maximum (as float32, exact for every input dtype) and the column it sits in to a small
[rows, chunks] scratch; the program that finishes last among a row's chunks (a ticket counter tells
it which) picks the winning chunk. A row that fits one chunk is written directly and takes no
ticket. The scratch is sized from the shape alone and nothing is read back to the host, so a CUDA
graph can capture the call.

The answer is torch.argmax's: the first of equal maxima (chunks are merged in column order), a
NaN beats every number (the first NaN wins), and a row of -inf gives index 0.
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
    check_counters,
    check_float_tensor,
    counters_ok,
    float_tensor_ok,
)

# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _first_max(x, idx, valid, sentinel):
    # (maximum, smallest index holding it) over the valid lanes of a block, torch's way: any NaN
    # is the maximum, and comes back as NaN with the smallest index of a NaN.
    is_nan = x != x
    nan_idx = tl.min(tl.where(valid & is_nan, idx, sentinel), axis=0)
    best = tl.max(tl.where(valid & ~is_nan, x, float("-inf")), axis=0)
    best_idx = tl.min(tl.where(valid & (x == best), idx, sentinel), axis=0)
    has_nan = nan_idx < sentinel
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, nan_idx, best_idx)


@triton.jit
def _merge_chunks(VALUES, INDICES, base, n_chunks, n_cols, BLOCK: tl.constexpr):
    # A row's chunk results in column order; a later block replaces the running best only when
    # strictly greater (or the first NaN), so ties keep the earlier column.
    best = float("-inf")
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, n_chunks, BLOCK):
        chunks = start + tl.arange(0, BLOCK)
        valid = chunks < n_chunks
        # .cg: from L2, where the other chunks' stores are, never a stale line of this SM's L1.
        v = tl.load(VALUES + base + chunks, mask=valid, other=float("-inf"), cache_modifier=".cg")
        i = tl.load(INDICES + base + chunks, mask=valid, other=0, cache_modifier=".cg")
        value, index = _first_max(v, i, valid, n_cols)
        best_is_nan = best != best
        take = ~best_is_nan & ((value != value) | (value > best))
        best = tl.where(take, value, best)
        best_idx = tl.where(take, index.to(tl.int64), best_idx)
    return best_idx


@triton.jit
def _argmax_kernel(
    X, OUT, SCRATCH, COUNTS, stride_row, n_cols, n_chunks, BLOCK: tl.constexpr, MERGE_BLOCK: tl.constexpr,
    ONE_CHUNK: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program (row, chunk) reduces columns [chunk · BLOCK, (chunk + 1) · BLOCK) of its row. Every
    # chunk holds at least one column, so the index written is always a real column. With several
    # chunks, SCRATCH holds the chunks' indices [rows, n_chunks] (int64), then their maxima (float32);
    # with one, SCRATCH and COUNTS are None.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < n_cols
    x = tl.load(X + row * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    value, index = _first_max(x, cols, valid, n_cols)
    if ONE_CHUNK:
        tl.store(OUT + row, index.to(tl.int64))  # the chunk's index is the row's answer
    else:
        base = row * n_chunks
        INDICES = SCRATCH
        VALUES = (INDICES + tl.num_programs(0).to(tl.int64) * n_chunks).to(tl.pointer_type(tl.float32), bitcast=True)
        tl.store(INDICES + base + chunk, index.to(tl.int64))
        tl.store(VALUES + base + chunk, value)
        # One thread takes the ticket (a scalar atomic, its result broadcast): the barrier orders the
        # stores before it, and the atomic's release makes them visible to the chunk that draws the
        # last ticket (acquire). That one merges the row, and puts the counter back to 0.
        tl.debug_barrier()
        ticket = tl.atomic_add(COUNTS + row, 1, sem="acq_rel", scope="gpu")
        if ticket == n_chunks - 1:
            tl.store(OUT + row, _merge_chunks(VALUES, INDICES, base, n_chunks, n_cols, MERGE_BLOCK))
            tl.store(COUNTS + row, 0)


# --------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------

# Columns per program. A 128256-wide vocabulary makes 32 chunks per row, 8 KB of
# bf16 each: enough programs to spread one row's read over the GPU, few enough that the merge is
# one small block. Read at call time, so tests can lower it to reach many chunks at small widths.
CHUNK = 4096
CHUNK_WARPS = 8  # 16 elements a thread at CHUNK = 4096: 16-byte vector loads, no spills
# Chunk results the merging program reduces per loop step; more chunks than this take several steps.
MAX_MERGE_BLOCK = 1024


def argmax_launch(x: torch.Tensor, counters: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on a [rows, cols] tensor with cols >= 1 and a unit column stride. counters: as
    argmax's, or None for a fresh zeroed buffer where a row takes several chunks; out: int64 [rows],
    unit stride, or None for a new tensor."""
    rows, n_cols = x.shape
    chunk = CHUNK
    n_chunks = cdiv(n_cols, chunk)
    scratch = None
    if n_chunks == 1 or rows == 0:
        if out is None:
            out = x.new_empty(rows, dtype=torch.int64)
        if rows == 0:
            return out
        counters = None  # the one chunk's program writes the output: no ticket, no scratch
    else:
        n_parts = rows * n_chunks
        # The chunks' indices (int64), then their maxima (float32, two to a slot); after the output when
        # the output is ours, in one allocation.
        width = n_parts + cdiv(n_parts, 2)
        if out is None:
            out = x.new_empty(rows + width, dtype=torch.int64)
            out, scratch = out[:rows], out[rows:]
        else:
            scratch = x.new_empty(width, dtype=torch.int64)
        if counters is None:
            counters = torch.zeros(rows, dtype=torch.int32, device=x.device)
    launcher = _argmax_launcher(chunk, n_chunks, MAX_MERGE_BLOCK, use_pdl(x.device))
    launcher((rows, n_chunks), x, out, scratch, counters, x.stride()[0], n_cols, n_chunks)
    return out


@functools.cache
def _argmax_launcher(chunk: int, n_chunks: int, max_merge_block: int, pdl: bool) -> Callable[..., None]:
    """The kernel with its compile-time arguments and launch options, once per chunk count."""
    return prepare(_argmax_kernel, BLOCK=chunk, MERGE_BLOCK=min(next_power_of_2(n_chunks), max_merge_block),
                   ONE_CHUNK=n_chunks == 1, USE_PDL=pdl, num_warps=CHUNK_WARPS, launch_pdl=pdl)


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------


def argmax(x: torch.Tensor, *, counters: torch.Tensor | None = None, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Index of the largest value in each row of a 2-D `x` [rows, cols]: int64 [rows] on x's device,
    written into `out` (int64 [rows], unit stride, on x's device) when given, and returned.

    Matches torch.argmax(x, dim=-1): ties go to the smallest index, NaN counts as the largest value
    (the first NaN's index), and a row of -inf gives 0. Rows may be strided (a view into a wider
    tensor is read in place); a column stride other than 1 is copied once. No host sync and no
    allocation that depends on the values, so the call can be captured in a CUDA graph.

    counters: the tickets that tell a row's last chunk to merge: an int32 buffer on x's device with
    at least `rows` elements, all zero; the kernel leaves them at zero, so a caller that launches on
    one stream may pass one buffer to every call (and a CUDA graph holds it by address). Two
    launches that may run at once (on two streams) must not share one. Default: a fresh zeroed
    buffer per call where a row takes several chunks.
    """
    shape = x.shape if float_tensor_ok(x) else None
    if shape is None or len(shape) != 2 or shape[1] == 0:
        check_float_tensor("x", x)  # the checks one by one, which name what is wrong
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
        raise ValueError(f"x must have at least one column to take the argmax of, got shape {tuple(x.shape)}")
    if counters is not None and not counters_ok(counters, shape[0], x.device):
        check_counters(counters, shape[0], x.device)
    if out is not None and not (isinstance(out, torch.Tensor) and out.dtype is torch.int64
                                and out.shape == shape[:1] and out.stride() == (1,) and out.device == x.device):
        _check_out(out, shape[0], x.device)
    if x.stride()[1] != 1 and shape[0] > 0:
        x = x.contiguous()
    return argmax_launch(x, counters, out)


def _check_out(out: object, rows: int, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.dtype != torch.int64:
        raise TypeError(f"out must be int64, got {out.dtype}")
    if out.shape != (rows,):
        raise ValueError(f"out must have shape ({rows},), one index a row of x, got {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but x is on {device}")
    raise ValueError(f"out must have a unit stride, got {out.stride()}")
