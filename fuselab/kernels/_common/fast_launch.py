"""`launch(kernel, grid, *args, **meta)`: `kernel[grid](*args, **meta)` without Triton's per-call Python.

Why: at decode size Triton 3.6's `JITFunction.run` costs tens of µs of host time a launch (binding the
arguments, specializing each, building and hashing a cache key with `str(options)`, checking globals,
building launch metadata, calling an empty hook chain), several times the GPU time of the kernel.
Here the first call of each specialization goes through Triton (which compiles, caches and launches);
the compiled kernel's own C launcher is kept, and later calls with the same specialization call it
directly on the current device's current stream, as `JITFunction.run` itself does. CUDA-graph
capture and programmatic dependent launch (`launch_pdl`, an option in the key) are unchanged.

The key is conservative: it holds everything Triton 3.6 specializes a compiled kernel on, and more.
Per positional argument (Triton's `native_specialize_impl`):
- a tensor: its dtype and whether its data pointer is 16-byte aligned; passed on as that pointer;
- an int: == 1 (Triton makes it a constant), divisible by 16, and which of i32 / i64 / u64 holds it;
- a float, bool or None: the type alone (Triton keeps the value out of its key, a None is a constant).
Keyword arguments (constexprs, num_warps, num_stages, launch_pdl) go in by name and exact value, and the
current device too (Triton caches compiled kernels per device). Anything else (other argument types, a
callable grid, a constexpr passed by position, a kernel that needs scratch memory or tensor
descriptors, a registered launch hook, another Triton version, the interpreter) launches through Triton.
FUSELAB_STOCK_LAUNCH=1 sends every launch through Triton, for comparison.

Not re-read per bound launch, as Triton's path would: TRITON_DEBUG / knobs.runtime.debug and the
instrumentation mode (process settings, fixed before the first launch), and the kernels' global
constants (module constants that fuselab never reassigns).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import triton

from fuselab.device import triton_interpreted

# The launcher layout below is read from Triton 3.6 (triton/backends/nvidia/driver.py, CudaLauncher).
_KNOWN_TRITON = triton.__version__.split(".")[:2] == ["3", "6"]
FAST = (
    _KNOWN_TRITON and not triton_interpreted() and os.environ.get("FUSELAB_STOCK_LAUNCH", "0") in ("", "0")
    and hasattr(torch._C, "_cuda_getCurrentRawStream")
)
if FAST:
    from triton import knobs

    _runtime_knobs = knobs.runtime
    _current_device = torch._C._cuda_getDevice
    _raw_stream = torch._C._cuda_getCurrentRawStream

_Tensor = torch.Tensor


class Bound(NamedTuple):
    """One compiled kernel's C launcher with what it takes besides the grid, stream and arguments."""

    launch: Any
    function: int
    cooperative: bool
    pdl: bool
    packed_metadata: tuple
    tail: tuple  # placeholders for the parameters after the positional ones: constexprs, which it skips
    owners: tuple  # (kernel, compiled kernel), kept alive with the entry: its key holds the kernel's id


# (id(kernel), device, argument keys..., keyword items...) -> Bound, or None: that one goes through Triton.
_bound: dict[tuple, Bound | None] = {}


def specialization_key(kernel: Any, device: int, args: tuple, meta: dict) -> tuple[tuple, list] | None:
    """(key, arguments for the C launcher) of a launch, or None when an argument is of a kind not handled here.

    An int's entry is -1 for 1, else (16 divides it) + 2 x (0: i32, 1: i64, 2: u64); a tensor's is its
    dtype followed by whether its pointer is 16-byte aligned (only a tensor puts a dtype in the key, so
    equal keys still mean equal kinds of arguments, position by position)."""
    key: list = [id(kernel), device]
    append = key.append
    call_args: list = []
    push = call_args.append
    for a in args:
        kind = type(a)
        if kind is int:
            append(-1 if a == 1 else (not a & 15) + (
                0 if -2147483648 <= a <= 2147483647 else 2 + 2 * (a > 9223372036854775807)))
        elif isinstance(a, _Tensor):
            ptr = a.data_ptr()
            append(a.dtype)
            append(not ptr & 15)
            a = ptr  # an int pointer: the launcher then skips its own data_ptr() call and pointer lookup
        elif a is None or kind is float or kind is bool:
            append(kind)
        else:
            return None
        push(a)
    key.extend(meta.items())
    return tuple(key), call_args


def bind(kernel: Any, compiled: Any, n_args: int) -> Bound | None:
    """The C launcher of `compiled` (what `kernel[grid](...)` returned) if it has Triton 3.6's layout and
    needs nothing `JITFunction.run` would add per call; else None."""
    params = getattr(kernel, "params", None)
    run = getattr(compiled, "run", None)
    launch = getattr(run, "launch", None)
    if params is None or launch is None or getattr(kernel, "pre_run_hooks", True):
        return None
    # Positional arguments fill the runtime parameters, keywords the constexprs: their values are in the key.
    if any(p.is_constexpr for p in params[:n_args]) or not all(p.is_constexpr for p in params[n_args:]):
        return None
    # Scratch buffers are allocated per launch and tensor descriptors converted per launch, in Python.
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    if getattr(launch, "__name__", None) != "launch" or not isinstance(compiled.packed_metadata, tuple):
        return None
    return Bound(launch, compiled.function, run.launch_cooperative_grid, run.launch_pdl, compiled.packed_metadata,
                 (None,) * (len(params) - n_args), (kernel, compiled))


def launch(kernel: Any, grid: tuple, *args: Any, **meta: Any) -> None:
    """`kernel[grid](*args, **meta)`: runtime arguments by position, constexprs and options by keyword."""
    # A launch hook (a profiler's) wants the launch metadata that only Triton's path builds.
    if (not FAST or type(grid) is not tuple or getattr(_runtime_knobs.launch_enter_hook, "calls", True)
            or getattr(_runtime_knobs.launch_exit_hook, "calls", True)):
        kernel[grid](*args, **meta)
        return
    device = _current_device()
    found = specialization_key(kernel, device, args, meta)
    bound = None if found is None else _bound.get(found[0], False)
    if not bound:
        compiled = kernel[grid](*args, **meta)
        if bound is False:
            _bound[found[0]] = bind(kernel, compiled, len(args))
        return
    run, function, cooperative, pdl, packed_metadata, tail, _ = bound
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _raw_stream(device), function, cooperative, pdl,
        None, None, packed_metadata, None, None, None, *found[1], *tail)
