"""silu(x · Wgᵀ) · (x · Wuᵀ) for one row of x: a Llama MLP's gate/up projection and its SwiGLU in one launch.

At batch 1 the engine's MLP ran `silu_and_mul(linear(x, gate_up_weight))`: a cuBLAS call, then the
SwiGLU kernel, two launches whose host cost exceeds the product's GPU time on small models. Here
one program owns BLOCK_N columns of gate and the same columns of up, so it holds both halves of
its outputs and applies the activation itself; the projection [2I] is never written.

The weight is the nn.Linear weight [2I, K] stored in-major (`in_major_linear` in
fuselab/engine/model.py): the .t() view of a row-major [K, 2I] matrix, so each of its K rows of
2I contiguous elements is [gate | up] for one input feature. A program walks K in BLOCK_K steps,
loading a [BLOCK_K, BLOCK_N] tile of gate and one of up a step (rows contiguous along the
columns: coalesced), and requests the next step's tiles before it multiplies the current ones.

split-K (the ticket reduction of quantized_gemm): where the column tiles alone are too few
programs to fill the SMs, SPLIT_K programs share a tile, each walking a contiguous run of the
steps. Each stores its fp32 sums of gate and up to a workspace and takes a ticket from the tile's
counter; the split drawing the last adds the partials in split order (the same sums whichever
split ends last: deterministic), applies the activation, stores y and sets the counter back to zero.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.fast_launch import prepare
from fuselab.kernels._common.launch import cdiv, next_power_of_2, sm_count, use_pdl
from fuselab.kernels._common.validate import (
    FLOAT_DTYPES,
    needs_autograd,
    on_kernel_device,
)
from fuselab.kernels.linear import check_linear_inputs

# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _store_y(g, u, Y, cols, col_ok):
    # The two-launch path stores the projection in x's dtype before the activation reads it: the
    # same rounding here, then swiglu.py's fp32 math, silu(g) · u.
    dtype = Y.dtype.element_ty
    g = g.to(dtype).to(tl.float32)
    u = u.to(dtype).to(tl.float32)
    tl.store(Y + cols, (g * tl.sigmoid(g) * u).to(dtype), mask=col_ok)


@triton.jit
def _gate_up_swiglu_kernel(
    X, W, Y, WS, COUNTS, I, K, stride_wk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Grid (column tiles, splits). W[k, n] is at W + k · stride_wk + n: gate columns 0..I-1, up I..2I-1.
    # Without split-K, WS and COUNTS are None; with it, COUNTS None means the counters follow the workspace.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    # This split's steps: a contiguous run; the splits' runs differ by one step at most (none for a
    # split past the steps, which stores zero partials).
    n_steps = tl.cdiv(K, BLOCK_K)
    first = split * n_steps // SPLIT_K
    end = (split + 1) * n_steps // SPLIT_K
    k_end = tl.minimum(end * BLOCK_K, K)
    rows = first * BLOCK_K + ks
    g_ptrs = W + rows[:, None].to(tl.int64) * stride_wk + cols[None, :]
    ok = (rows < k_end)[:, None] & col_ok[None, :]
    # The first step of W does not depend on the kernel before: with PDL its read overlaps that kernel's end.
    wg = tl.load(g_ptrs, mask=ok, other=0.0)
    wu = tl.load(g_ptrs + I, mask=ok, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output (x)
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    # Products summed across K once, after the loop: the loop body is a multiply-add per element.
    acc_g = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for step in range(first, end):
        x = tl.load(X + rows, mask=rows < k_end, other=0.0).to(tl.float32)[:, None]
        # The next step's tiles are requested before this one's are used (masked off past the run),
        # so that each program keeps two steps of W in flight.
        rows += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        ok = (rows < k_end)[:, None] & col_ok[None, :]
        next_g = tl.load(g_ptrs, mask=ok, other=0.0)
        next_u = tl.load(g_ptrs + I, mask=ok, other=0.0)
        acc_g += wg.to(tl.float32) * x
        acc_u += wu.to(tl.float32) * x
        wg, wu = next_g, next_u
    g = tl.sum(acc_g, axis=0)
    u = tl.sum(acc_u, axis=0)
    if SPLIT_K == 1:
        _store_y(g, u, Y, cols, col_ok)
    else:
        # Partials [tiles, SPLIT_K, 2, BLOCK_N]: a split's sums of gate, then of up.
        parts = WS + pid_n.to(tl.int64) * (SPLIT_K * 2 * BLOCK_N) + tl.arange(0, BLOCK_N)
        tl.store(parts + split * (2 * BLOCK_N), g, mask=col_ok)
        tl.store(parts + split * (2 * BLOCK_N) + BLOCK_N, u, mask=col_ok)
        # One thread takes the ticket (Triton issues a scalar atomic from one thread and broadcasts
        # its result): the barrier orders every thread's share of the partials before it, and the
        # atomic's release makes them visible to the split that draws the last ticket (acquire).
        tl.debug_barrier()
        counts = COUNTS
        if COUNTS is None:
            counts = (WS + tl.num_programs(0) * (SPLIT_K * 2 * BLOCK_N)).to(tl.pointer_type(tl.int32), bitcast=True)
        ticket = tl.atomic_add(counts + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
            total_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for i in tl.static_range(SPLIT_K):
                if i == split:
                    total_g += g  # this split's own partials, still in registers
                    total_u += u
                else:
                    # .cg: from L2, where the other splits' stores are, never a stale line of this SM's L1.
                    total_g += tl.load(parts + i * (2 * BLOCK_N), mask=col_ok, other=0.0, cache_modifier=".cg")
                    total_u += tl.load(parts + i * (2 * BLOCK_N) + BLOCK_N, mask=col_ok, other=0.0,
                                       cache_modifier=".cg")
            _store_y(total_g, total_u, Y, cols, col_ok)
            tl.store(counts + pid_n, 0)


# --------------------------------------------------------------------------------------------
# Config rule and launcher
# --------------------------------------------------------------------------------------------

MAX_BLOCK_N = 128
MAX_BLOCK_K = 32
MAX_SPLIT_K = 4
# Programs an SM the rule asks for with split-K.
PROGRAMS_PER_SM = 2
NUM_WARPS = 4
# Without split-K (max_split_k=1): longer steps over 8 warps keep more of W in flight a program.
UNSPLIT_BLOCK_N, UNSPLIT_BLOCK_K, UNSPLIT_WARPS = 64, 64, 8


@functools.lru_cache(maxsize=1024)
def gate_up_config(k: int, i: int, sms: int, max_split_k: int = MAX_SPLIT_K) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps) for K input features and I outputs (a [K, 2I] weight).

    - BLOCK_N: 128 columns of gate and of up (whole cache lines of a 16-bit row), fewer for small I
      (I rounded up to a power of two); BLOCK_K: 32 rows a step (fewer for small K).
    - SPLIT_K: the smallest power of two up to max_split_k (and K's steps) that gives PROGRAMS_PER_SM
      programs an SM: Llama 3 1B (K=2048, I=8192) and 8B (K=4096, I=14336) get 4, the fastest of the
      configs timed on an H200 at both (23.6 and 60.8 µs in a CUDA graph, weights from HBM; cuBLAS
      and the SwiGLU kernel took 19.7 and 58.8).
    - max_split_k=1 (no workspace, no ticket buffer: the launch cheapest on the host): 64 columns,
      steps of 64 rows, 8 warps (31 and 73 µs at those shapes).
    """
    if max_split_k <= 1:
        return min(UNSPLIT_BLOCK_N, next_power_of_2(i)), min(UNSPLIT_BLOCK_K, next_power_of_2(k)), 1, UNSPLIT_WARPS
    block_n = min(MAX_BLOCK_N, next_power_of_2(i))
    block_k = min(MAX_BLOCK_K, next_power_of_2(k))
    tiles, steps = cdiv(i, block_n), cdiv(k, block_k)
    split_k = 1
    while tiles * split_k < PROGRAMS_PER_SM * sms and split_k < max_split_k:
        split_k *= 2
    return block_n, block_k, max(1, min(split_k, steps)), NUM_WARPS


def _check_config(config: object) -> tuple[int, int, int, int]:
    if not (isinstance(config, tuple) and len(config) == 4 and all(type(v) is int for v in config)):
        raise ValueError(f"config must be a tuple of 4 ints (BLOCK_N, BLOCK_K, SPLIT_K, num_warps), got {config!r}")
    block_n, block_k, split_k, num_warps = config
    if min(block_n, block_k, split_k) < 1 or block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"config's BLOCK_N and BLOCK_K must be powers of two and SPLIT_K >= 1, got {config}")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"config's num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
    return config


def gate_up_swiglu_launch(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int, int] | None = None,
                          counters: torch.Tensor | None = None, max_split_k: int = MAX_SPLIT_K) -> torch.Tensor:
    """y [..., I] for x with one row of K contiguous elements and weight [2I, K] with stride 1 along
    dim 0 (inputs checked by the caller, gate_up_swiglu), K and I > 0.

    config: (BLOCK_N, BLOCK_K, SPLIT_K, num_warps), gate_up_config's (for max_split_k) by default.
    counters: int32, at least cdiv(I, BLOCK_N), at zero; the kernel leaves them at zero, so a caller
    may keep one buffer for its calls on one stream and save a zeroing launch a call. By default
    fresh zeroed ones per call with split-K, after the workspace in its allocation (a buffer kept by
    this module would be shared by every stream and graph: two replaying at once would mix their tickets)."""
    two_i, k = weight.shape
    i = two_i // 2
    block_n, block_k, split_k, num_warps = (
        gate_up_config(k, i, sm_count(x.device), max_split_k) if config is None else _check_config(config))
    y = x.new_empty(*x.shape[:-1], i)
    tiles = cdiv(i, block_n)
    workspace = None  # one split stores y itself
    if split_k > 1:
        n_partials = tiles * split_k * 2 * block_n
        if counters is None:  # the counters after the partials, zeroed with them: one allocation
            workspace = torch.zeros(n_partials + tiles, device=x.device, dtype=torch.float32)
        else:
            workspace = torch.empty(n_partials, device=x.device, dtype=torch.float32)
    launcher = _launcher(block_n, block_k, split_k, num_warps, use_pdl(x.device))
    launcher((tiles, split_k), x, weight, y, workspace, counters, i, k, weight.stride()[1])
    return y


@functools.cache
def _launcher(block_n: int, block_k: int, split_k: int, num_warps: int, pdl: bool) -> Callable[..., None]:
    """The kernel with its compile-time arguments and launch options, once per config."""
    return prepare(_gate_up_swiglu_kernel, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, USE_PDL=pdl,
                   num_warps=num_warps, num_stages=1, launch_pdl=pdl)


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


def _check(x: object, weight: object) -> None:
    check_linear_inputs(x, weight)
    if weight.shape[0] % 2:
        raise ValueError(f"weight's first dim holds [gate | up] and must be even, got {weight.shape[0]}")
    if x.numel() != x.shape[-1]:
        raise ValueError(f"x must hold one row (a batch-1 decode step), got shape {tuple(x.shape)}; "
                         "for more rows use linear and silu_and_mul")
    if weight.stride()[0] != 1:
        raise ValueError(f"weight must be stored in-major: stride 1 along its first dim, as the .t() view of a "
                         f"row-major [in_features, 2 * intermediate] matrix (in_major_linear's weight) has; got "
                         f"strides {weight.stride()} for shape {tuple(weight.shape)}")


def _inputs_ok(x: object, weight: object) -> bool:
    """`_check` would pass: x and weight of one float dtype on the kernels' device, one row, shapes
    that fit, the weight in-major."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return False
    x_shape, w_shape = x.shape, weight.shape
    return (x.dtype in FLOAT_DTYPES and weight.dtype is x.dtype and on_kernel_device(x) and len(w_shape) == 2
            and w_shape[0] % 2 == 0 and len(x_shape) > 0 and x_shape[-1] == w_shape[1]
            and weight.device == x.device and x.numel() == x_shape[-1] and weight.stride()[0] == 1)


def gate_up_swiglu(x: torch.Tensor, weight: torch.Tensor, *, max_split_k: int = MAX_SPLIT_K) -> torch.Tensor:
    """`silu_and_mul(linear(x, weight))` in one launch, for inference: x [..., K] holding one row,
    weight [2I, K] = [gate | up] along its first dim, as nn.Linear holds it; returns [..., I] in x's dtype.

    The weight must be stored in-major, stride 1 along its first dim: the .t() view of a row-major
    [K, 2I] matrix, which is what `in_major_linear`'s weight is (any row pitch of that matrix is read
    as it is). The sums are fp32; gate and up are rounded to x's dtype before silu(gate) · up, as the
    two-launch path stores them. max_split_k bounds how many programs share a tile of outputs: split-K
    fills the GPU at these shapes, and costs the host a workspace and a ticket buffer a call; 1 gives
    the launch cheapest on the host. Not differentiable: inputs that require grad while grad mode is
    on are refused.
    """
    if not _inputs_ok(x, weight):
        _check(x, weight)  # one by one, naming what is wrong
    if needs_autograd(x, weight):
        raise RuntimeError("gate_up_swiglu is not differentiable (it is for inference): x or weight requires grad; "
                           "call it under torch.no_grad() or torch.inference_mode(), or use linear and silu_and_mul")
    if isinstance(max_split_k, bool) or not isinstance(max_split_k, int) or max_split_k < 1:
        raise ValueError(f"max_split_k must be a positive int, got {max_split_k!r}")
    two_i, k = weight.shape
    if two_i == 0 or k == 0:
        return x.new_zeros(*x.shape[:-1], two_i // 2)  # no outputs, or each a sum of nothing
    if x.stride()[-1] != 1:
        x = x.contiguous()
    return gate_up_swiglu_launch(x, weight, max_split_k=max_split_k)
