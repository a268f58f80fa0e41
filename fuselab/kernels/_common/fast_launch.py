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
FUSELAB_STOCK_LAUNCH=1 sends every launch through Triton, for comparison; so does `stock_launches()`,
for a stretch of one process.

How a launch finds its launcher: per kernel and argument layout (which positions hold a tensor, an int, a
float, a bool or None, and how many grid dimensions) one small function is generated, once, the first time
a launch has that layout (`_binder_source`). It checks the layout, builds an exact key in straight-line
code (no loop over the arguments, no chain of isinstance tests: tensors as dtype and alignment, ints as
they are), looks it up, and calls the bound launcher with the arguments as they are and tensors as their
pointers. An exact key not seen before is reduced to the key above (`specialization`), which finds the
bound launcher of an int of the same class, or goes through Triton. A launch of another layout is handed
to the next such function of its kernel, or gets one of its own. `prepare(kernel, **meta)` gives a launch
site its own such functions for keywords fixed once, which keep them out of the per-call key.

Not re-read per bound launch, as Triton's path would: TRITON_DEBUG / knobs.runtime.debug and the
instrumentation mode (process settings, fixed before the first launch), and the kernels' global
constants (module constants that fuselab never reassigns).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
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
    owners: tuple  # (kernel, compiled kernel), kept alive with the entry


# id(kernel) -> the generated binders of its argument layouts seen so far, tried in order (see _binder_source).
_binders: dict[int, tuple[Callable[..., bool], ...]] = {}

# How many exact keys a binder keeps before it starts over (a workload of ever new sizes would grow them).
_EXACT_KEYS = 1024


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


def specialization(device: int, args: tuple, meta: dict) -> tuple:
    """The key of what Triton compiles a launch for: the device, then per argument a tensor's dtype and
    whether its pointer is 16-byte aligned, an int's class (-1 for 1, else (16 divides it) + 2 x (0: i32,
    1: i64, 2: u64)) or another argument's type, then the keywords (only a tensor puts a dtype in the key,
    so equal keys mean equal kinds of arguments, position by position)."""
    key: list = [device]
    append = key.append
    for a in args:
        kind = type(a)
        if kind is int:
            append(-1 if a == 1 else (not a & 15) + (
                0 if -2147483648 <= a <= 2147483647 else 2 + 2 * (a > 9223372036854775807)))
        elif isinstance(a, _Tensor):
            append(a.dtype)
            append(not a.data_ptr() & 15)
        else:
            append(kind)
    key.extend(meta.items())
    return tuple(key)


# The kinds a binder handles, by type: the test that a later argument is of that kind again.
_KIND_TESTS = {int: "type({a}) is int", float: "type({a}) is float", bool: "type({a}) is bool",
               type(None): "{a} is None"}


def _layout(args: tuple) -> str | None:
    """One letter per argument (t: tensor, i: int, f: float, b: bool, n: None), or None when one is of
    another kind."""
    letters = []
    for a in args:
        kind = type(a)
        if kind in _KIND_TESTS:
            letters.append("ifbn"[(int, float, bool, type(None)).index(kind)])
        elif isinstance(a, _Tensor):
            letters.append("t")
        else:
            return None
    return "".join(letters)


def _binder_source(layout: str, grid_dims: int, n_tail: int, fixed_meta: bool = False) -> str:
    """The source of `make(kernel, exact, specializations, meta) -> binder` for one argument layout and grid
    size.

    The binder, `go(device, grid, args, meta) -> bool`, returns False (having done nothing) when the launch
    has another layout, else launches. Its exact key holds the device, each tensor's dtype and pointer
    alignment, each int as it is and the keywords: a finer key than `specialization`'s, which is computed
    (in `_first_launch`) only for an exact key not seen yet, so that a launch of sizes seen before pays no
    per-int classification. `exact` maps exact keys to the Bound of their specialization. With
    `fixed_meta` (a `prepare`d launch) the keywords are make's `meta`, the same for every launch of the
    binder: `go(device, grid, args)`, and they stay out of the key."""
    names = [f"a{i}" for i in range(len(layout))]
    tests, pointers, key, passed = [], [], ["device"], []
    for a, letter in zip(names, layout):
        if letter == "t":
            tests.append(f"isinstance({a}, _Tensor)")
            pointers.append(f"p{a} = {a}.data_ptr()")
            key += [f"{a}.dtype", f"not p{a} & 15"]
            passed.append(f"p{a}")
            continue
        tests.append(_KIND_TESTS[{"i": int, "f": float, "b": bool, "n": type(None)}[letter]].format(a=a))
        if letter == "i":
            key.append(a)
        passed.append(a)
    dims = [f"g{d}" for d in range(grid_dims)]
    grid_xyz = ", ".join(dims + ["1"] * (3 - grid_dims))
    unpack_args = f"{', '.join(names)}, = args" if names else "if args: return False"
    lines = [
        "def make(kernel, exact, specializations, meta):",
        f"    def go(device, grid, args{'' if fixed_meta else ', meta'}):",
        "        try:",
        f"            {unpack_args}",
        f"            {', '.join(dims)}, = grid",
        "        except ValueError:",
        "            return False",
    ]
    if tests:
        lines.append(f"        if not ({' and '.join(tests)}):")
        lines.append("            return False")
    lines += [f"        {line}" for line in pointers]
    lines += [
        f"        key = ({', '.join(key)}{',' if fixed_meta else ', *meta.items()'})",
        "        bound = exact.get(key)",
        "        if bound is None:",
        "            _first_launch(kernel, exact, specializations, key, grid, args, meta)",
        "            return True",
        "        run, function, cooperative, pdl, packed_metadata, _, _ = bound",
        f"        run({grid_xyz}, _raw_stream(device), function, cooperative, pdl, None, None, packed_metadata,"
        f" None, None, None, {', '.join(passed + ['None'] * n_tail)})",
        "        return True",
        "    go.exact, go.specializations = exact, specializations",
        "    return go",
    ]
    return "\n".join(lines) + "\n"


def _first_launch(kernel: Any, exact: dict, specializations: dict, key: tuple, grid: tuple, args: tuple,
                  meta: dict) -> None:
    """A launch whose exact key is not known: through Triton the first time of its specialization (binding
    what Triton compiled, or None where it cannot be bound), else as that specialization launches."""
    device = key[0]
    found = specialization(device, args, meta)
    if found not in specializations:
        compiled = kernel[grid](*args, **meta)
        bound = specializations[found] = bind(kernel, compiled, len(args))
    else:
        bound = specializations[found]
        if bound is None:
            kernel[grid](*args, **meta)
        else:
            grid_xyz = (*grid, 1, 1)[:3]
            pointers = [a.data_ptr() if isinstance(a, _Tensor) else a for a in args]
            bound.launch(*grid_xyz, _raw_stream(device), bound.function, bound.cooperative, bound.pdl, None, None,
                         bound.packed_metadata, None, None, None, *pointers, *bound.tail)
    if bound is not None:
        if len(exact) >= _EXACT_KEYS:
            exact.clear()
        exact[key] = bound


def _new_binder(kernel: Any, grid: tuple, args: tuple, meta: dict | None = None) -> Callable[..., bool] | None:
    """A binder for the layout of `args` (added to the kernel's, unless it is for a `prepare`d launch's fixed
    keywords `meta`), or None when it is not one handled here."""
    params = getattr(kernel, "params", None)
    layout = _layout(args)
    if params is None or layout is None or not 1 <= len(grid) <= 3 or len(params) < len(args):
        return None
    namespace: dict = {}
    source = _binder_source(layout, len(grid), len(params) - len(args), fixed_meta=meta is not None)
    # Defined in this module's globals, so that the stream and hook functions are looked up here per call.
    exec(compile(source, f"<fast_launch {layout}>", "exec"), globals(), namespace)
    go = namespace["make"](kernel, {}, {}, meta)
    if meta is None:
        _binders[id(kernel)] = (*_binders.get(id(kernel), ()), go)
    return go


def launch(kernel: Any, grid: tuple, *args: Any, **meta: Any) -> None:
    """`kernel[grid](*args, **meta)`: runtime arguments by position, constexprs and options by keyword."""
    # A launch hook (a profiler's) wants the launch metadata that only Triton's path builds.
    if (not FAST or type(grid) is not tuple or getattr(_runtime_knobs.launch_enter_hook, "calls", True)
            or getattr(_runtime_knobs.launch_exit_hook, "calls", True)):
        kernel[grid](*args, **meta)
        return
    device = _current_device()
    for go in _binders.get(id(kernel), ()):
        if go(device, grid, args, meta):
            return
    go = _new_binder(kernel, grid, args)
    if go is None:
        kernel[grid](*args, **meta)
    else:
        go(device, grid, args, meta)


def prepare(kernel: Any, **meta: Any) -> Callable[..., None]:
    """`launch` with its keywords given once: `prepare(kernel, **meta)(grid, *args)` launches as
    `launch(kernel, grid, *args, **meta)` does, without building the keywords and hashing them into the
    key at every call (about 1.5 µs of host time for a dozen). For a launch site that keeps one per
    configuration (`functools.cache`). `meta` is a dict of its own: a later change to a dict the caller
    unpacked into it changes nothing."""
    binders: list[Callable[..., bool]] = []  # by argument layout, as the kernel's binders of `launch`

    def prepared(grid: tuple, *args: Any) -> None:
        # As in `launch` (the test inline: this runs at every launch).
        if (not FAST or type(grid) is not tuple or getattr(_runtime_knobs.launch_enter_hook, "calls", True)
                or getattr(_runtime_knobs.launch_exit_hook, "calls", True)):
            kernel[grid](*args, **meta)
            return
        device = _current_device()
        for go in binders:
            if go(device, grid, args):
                return
        go = _new_binder(kernel, grid, args, meta)
        if go is None:
            kernel[grid](*args, **meta)
        else:
            binders.append(go)
            go(device, grid, args)

    return prepared


@contextlib.contextmanager
def stock_launches() -> Iterator[None]:
    """Every launch inside goes through Triton's own launcher, for comparison with the bound one. It
    switches the whole process (every thread), so it is for measurements and tests, not for serving."""
    global FAST
    saved, FAST = FAST, False
    try:
        yield
    finally:
        FAST = saved
