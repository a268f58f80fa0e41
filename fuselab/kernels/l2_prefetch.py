"""Bring a byte range of a CUDA tensor into the L2 cache ahead of the kernel that reads it.

Why: at batch 1 a decode step's projections stream their weights from HBM while the short kernels
between them (norms, RoPE, attention, SwiGLU) leave HBM idle. A prefetch launched on a side stream
during those kernels moves the next projection's first bytes into L2 (50 MB on Hopper), so that the
projection reads them from L2 and HBM stays busy through the gap.

Each thread issues one Hopper bulk prefetch (`cp.async.bulk.prefetch.L2`) of up to CHUNK bytes and
exits: the copy engine finishes it on its own, and nothing waits for it. Elsewhere (no sm_90, the
interpreter) it does nothing: a prefetch is a hint and changes no result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.launch import cdiv

CHUNK = 4096  # bytes a thread asks for: a range of 33 MB spreads over ~64 programs
THREADS = 128


@triton.jit
def _l2_prefetch_kernel(base, n_bytes, CHUNK: tl.constexpr, THREADS: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * (CHUNK * THREADS) + tl.arange(0, THREADS).to(tl.int64) * CHUNK
    size = tl.maximum(tl.minimum(n_bytes - offsets, CHUNK), 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [base + offsets, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_available(device: torch.device) -> bool:
    """Whether `prefetch_l2` does anything on `device`: a CUDA GPU of compute capability 9.0 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def prefetch_l2(tensor: torch.Tensor, start: int = 0, n_bytes: int | None = None) -> None:
    """Ask for bytes [start, start + n_bytes) of `tensor`'s storage (contiguous, from its data pointer) in L2,
    on the current stream; the range is clipped to the tensor and rounded down to 16 bytes."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"prefetch_l2: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    total = tensor.numel() * tensor.element_size()
    if start < 0 or (n_bytes is not None and n_bytes < 0):
        raise ValueError(f"prefetch_l2: start and n_bytes must be >= 0, got {start} and {n_bytes}")
    n_bytes = total - start if n_bytes is None else min(n_bytes, total - start)
    n_bytes = n_bytes // 16 * 16
    base = tensor.data_ptr() + start
    if base % 16:
        raise ValueError(f"prefetch_l2: the range must start 16-byte aligned, got address offset {base % 16}")
    if n_bytes <= 0 or not prefetch_available(tensor.device):
        return
    grid = (cdiv(n_bytes, CHUNK * THREADS),)
    _l2_prefetch_kernel[grid](base, n_bytes, CHUNK=CHUNK, THREADS=THREADS, num_warps=THREADS // 32)
