"""What kernel launchers share: integer helpers, the SM count, the grid of row-block elementwise
kernels, and whether a launch uses programmatic dependent launch.

Triton's own `triton.cdiv` and `triton.next_power_of_2` are constexpr functions: called from host
code, each goes through a wrapper that unwraps its arguments first, a few µs a call. A launcher
that needs several of them per call pays that at every decode step; these are plain Python.
"""

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from fuselab.device import triton_interpreted

# Programmatic dependent launch (Hopper and newer), inside `dependent_launches()`: a kernel may start
# while the kernel before it drains its last wave; it loads what no kernel of the step writes (the
# weights), then waits (gdc_wait) before it reads that kernel's output or writes anything. In a
# graph-captured decode step this hides most of the ramp-up and tail of ~10 short kernels a layer
# (docs/tuning/common-constants.md). A kernel lets the next one launch (gdc_launch_dependents) right
# after its own wait, so that the next kernel's programs take the SMs it leaves idle and read their
# weights during its run; the one-row GEMVs (bf16 and quantized weights) trigger after their loop.
# FUSELAB_PDL=0 turns it off.
_PDL_ALLOWED = os.environ.get("FUSELAB_PDL", "1") != "0" and not triton_interpreted()
# Whether launches now are inside `dependent_launches()`: a context variable, so the scope is one
# thread's (and one asyncio task's), never another's.
_pdl_scope: contextvars.ContextVar[bool] = contextvars.ContextVar("fuselab_dependent_launches", default=False)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


@functools.lru_cache(maxsize=4096)
def row_block_grid(n_rows: int, n_cols: int, max_block: int) -> tuple[tuple[int], int]:
    """((programs,), block) for an elementwise kernel over rows cut into blocks of at most max_block
    columns, one program a (row, block), numbered in memory order (`row_and_columns`)."""
    block = min(max_block, next_power_of_2(n_cols))
    return (n_rows * cdiv(n_cols, block),), block


@triton.jit
def row_and_columns(n_cols, BLOCK: tl.constexpr):
    """(row, its columns) of this program on a `row_block_grid`: a row's blocks, then the next row's.
    Programs that run together read neighbouring memory, which a (rows, column blocks) grid, reading
    every row's first block before any second one, does not (docs/tuning/common-constants.md)."""
    pid = tl.program_id(0)
    blocks = tl.cdiv(n_cols, BLOCK)
    return (pid // blocks).to(tl.int64), (pid % blocks) * BLOCK + tl.arange(0, BLOCK)


@functools.cache
def _pdl_on(device_index: int) -> bool:
    return _PDL_ALLOWED and torch.cuda.get_device_capability(device_index)[0] >= 9


@contextlib.contextmanager
def dependent_launches() -> Iterator[None]:
    """Kernels launched in this block (on one thread) use programmatic dependent launch where the
    GPU has it. Only for work in which no kernel writes a weight that a later kernel reads (an
    inference step): a kernel reads its weights before it waits for the kernel before it."""
    token = _pdl_scope.set(True)
    try:
        yield
    finally:
        _pdl_scope.reset(token)


def pdl_allowed() -> bool:
    """False when FUSELAB_PDL=0 (or in the interpreter): no kernel uses programmatic dependent launch."""
    return _PDL_ALLOWED


def use_pdl(device: torch.device) -> bool:
    """Whether a kernel launched now on `device` uses programmatic dependent launch."""
    if not _pdl_scope.get() or device.type != "cuda":
        return False
    return _pdl_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# What launch configs assume of a device that is not a GPU (the interpreter's CPU tensors): a few SMs,
# so that tests at small sizes still take the paths that split work to fill them.
_INTERPRETER_SMS = 4


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device; None index: the current one), or
    _INTERPRETER_SMS for any other device."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def resident_programs(compiled, device: torch.device) -> int:
    """How many programs of a compiled Triton kernel a CUDA device runs at once: its SMs times as many
    as fit on one by threads, registers and shared memory."""
    compiled._init_handles()  # loads the binary: its register count is known from then on
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    threads = 32 * compiled.metadata.num_warps
    per_sm = min(
        props.max_threads_per_multi_processor // threads,
        _registers_per_sm(index) // max(1, compiled.n_regs * threads),
        props.shared_memory_per_multiprocessor // (compiled.metadata.shared + _RESERVED_SHARED_PER_PROGRAM),
    )
    return props.multi_processor_count * max(1, per_sm)


def _registers_per_sm(device_index: int) -> int:
    # A block may use all of an SM's registers (64K on sm_70 to sm_90): the per-block limit is the SM's.
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_num_regs"]


# Shared memory the driver keeps for each resident program (1 KiB since sm_80).
_RESERVED_SHARED_PER_PROGRAM = 1024
