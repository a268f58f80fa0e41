"""What the attention kernels share: tile loads and dots, the softmax scale, the head dims they
take, FlashAttention's launch configs, and how a sequence's rows are addressed in the padded
[batch, heads, seq, head_dim] and packed [tokens, heads, head_dim] layouts.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.launch import next_power_of_2
from fuselab.kernels._common.validate import INTERPRETED


@triton.jit
def load_tile(ptrs, row_ok, d_ok, CHECK_ROWS: tl.constexpr, PAD_D: tl.constexpr):
    """A 2-D tile, zero where a row is past the sequence (if CHECK_ROWS) or a column past the head
    dim (if PAD_D). The masks are broadcastable to the tile; unneeded ones are never evaluated, so
    interior blocks load without predicates."""
    if CHECK_ROWS:
        if PAD_D:
            tile = tl.load(ptrs, mask=row_ok & d_ok, other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok, other=0.0)
    else:
        if PAD_D:
            tile = tl.load(ptrs, mask=d_ok, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


# Triton's interpreter multiplies bfloat16 `tl.dot` operands as their raw 16-bit patterns. There,
# bf16 operands are widened to fp32 first (exactly); a compiled kernel never takes the branch.
_WIDEN_BF16_DOTS = tl.constexpr(INTERPRETED)


@triton.jit
def tile_dot(a, b, acc, PRECISION: tl.constexpr):
    """tl.dot(a, b, acc) of two tiles of one dtype (acc None: a new fp32 sum), right in the interpreter too."""
    if _WIDEN_BF16_DOTS:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def sequence_span(CU_SEQLENS, batch, seq_q, seq_k, VARLEN: tl.constexpr):
    """(first row, query rows, key rows) of sequence `batch`: from cu_seqlens when packed (as many
    keys as queries; seq_q is then the number of tokens), else row 0 of its own batch entry and the
    padded lengths. Packed offsets are clamped to [0, tokens] and a sequence's end to its start, so
    that no cu_seqlens makes a kernel read or write rows outside the tensors: two scalars a program."""
    if VARLEN:
        first_row = tl.minimum(tl.maximum(tl.load(CU_SEQLENS + batch), 0), seq_q)
        end = tl.minimum(tl.maximum(tl.load(CU_SEQLENS + batch + 1), first_row), seq_q)
        seq_q = end - first_row
        seq_k = seq_q
        first_row = first_row.to(tl.int64)
    else:
        first_row = batch.to(tl.int64) * 0
    return first_row, seq_q, seq_k


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------


def row_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, row) strides: row i of sequence b, head h sits at b·sb + h·sh + (first_row(b) + i)·ss.

    Packed tensors have no batch dim: a sequence starts at its cu_seqlens row, so the batch stride is 0.
    """
    if varlen:
        return 0, t.stride(1), t.stride(0)
    return t.stride(0), t.stride(1), t.stride(2)


def new_row_stats(q: torch.Tensor, varlen: bool) -> tuple[torch.Tensor, tuple[int, int]]:
    """An fp32 per-(row, head) buffer (log-sum-exp, delta) and its (batch, head) strides; rows are unit-stride."""
    if varlen:
        total, heads = q.shape[0], q.shape[1]
        return torch.empty(heads, total, device=q.device, dtype=torch.float32), (0, total)
    batch, heads, seq = q.shape[:3]
    return torch.empty(batch, heads, seq, device=q.device, dtype=torch.float32), (heads * seq, seq)


# Scores are exponentiated with exp2: the softmax scale is folded with log2(e).
LOG2E = math.log2(math.e)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale: 1/sqrt(head_dim) by default, else a positive finite number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    # Positive, so that the row maximum of the scaled scores is the scaled row maximum.
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs exist for testing: keep them exact instead of rounding to tf32.
    return "ieee" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------------------------
# Launch configs
# --------------------------------------------------------------------------------------------


class ForwardConfig(NamedTuple):
    block_m: int  # query rows per program
    block_n: int  # keys per loop step; block_m must be a multiple of it (causal diagonal)
    num_warps: int
    num_stages: int


class BackwardConfig(NamedTuple):
    block_m1: int  # dk/dv pass: query rows per loop step
    block_n1: int  # dk/dv pass: keys per program; a multiple of block_m1
    block_m2: int  # dq pass: query rows per program; a multiple of block_n2
    block_n2: int  # dq pass: keys per loop step
    num_warps: int
    num_stages: int


# Hopper (sm_90), keyed by the head dim rounded up to a power of two, bounded by shared memory: chosen by
# `fuselab bench attention --sweep` on an H200 (docs/tuning/flash_attention-constants.md).
FORWARD_CONFIGS: dict[int, ForwardConfig] = {
    16: ForwardConfig(128, 64, 4, 3),
    32: ForwardConfig(128, 64, 4, 3),
    64: ForwardConfig(128, 64, 8, 4),
    128: ForwardConfig(128, 64, 8, 3),
    256: ForwardConfig(64, 64, 8, 2),
}
# The forward kernel whose tiles move through TMA descriptors, keyed by (padded head dim, causal), where
# it beat the pointer kernel above in the same sweep. It serves padded, contiguous inputs with a
# power-of-two head dim; everything else (packed sequences, strided views) takes the pointer kernel.
TMA_FORWARD_CONFIGS: dict[tuple[int, bool], ForwardConfig] = {
    (128, True): ForwardConfig(64, 64, 4, 3),
    (128, False): ForwardConfig(128, 128, 8, 3),
}
# Causal attention over this many queries or more takes the non-causal tiles: most of a 128-row tile's key
# blocks are then unmasked, and the larger tiles were the faster from here on.
LONG_CAUSAL_SEQ = 8192
BACKWARD_CONFIGS: dict[int, BackwardConfig] = {
    16: BackwardConfig(32, 64, 64, 32, 4, 3),
    32: BackwardConfig(32, 64, 64, 32, 4, 3),
    64: BackwardConfig(32, 128, 128, 32, 4, 4),
    128: BackwardConfig(32, 128, 128, 32, 8, 3),
    256: BackwardConfig(16, 64, 64, 16, 8, 2),
}

# The interpreter runs programs one after another on the CPU: small blocks keep tests at small
# sizes crossing several blocks (and the causal diagonal spanning two key blocks).
INTERPRETER_FORWARD = ForwardConfig(32, 16, 1, 1)
INTERPRETER_BACKWARD = BackwardConfig(16, 32, 32, 16, 1, 1)

SUPPORTED_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


def padded_head_dim(head_dim: int) -> int:
    return next_power_of_2(head_dim)


def forward_config(head_dim: int) -> ForwardConfig:
    return INTERPRETER_FORWARD if INTERPRETED else FORWARD_CONFIGS[padded_head_dim(head_dim)]


def tma_forward_config(head_dim: int, causal: bool, seq_q: int) -> ForwardConfig | None:
    """The TMA kernel's tiles, or None where the pointer kernel is the faster (and in the interpreter)."""
    if INTERPRETED:
        return None
    return TMA_FORWARD_CONFIGS.get((head_dim, causal and seq_q < LONG_CAUSAL_SEQ))


def backward_config(head_dim: int) -> BackwardConfig:
    return INTERPRETER_BACKWARD if INTERPRETED else BACKWARD_CONFIGS[padded_head_dim(head_dim)]
