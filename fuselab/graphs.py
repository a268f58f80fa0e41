"""CUDA graphs for any callable: `graphed(fn)` captures fn once per batch-size bucket and replays it.

A CUDA graph turns the hundreds of kernel launches of a call into one replay, but it replays fixed
addresses and fixed shapes. `graphed` hides both:

- Buckets. fn is captured for a set of batch sizes (by default 1, 2, 4, 8, then every multiple of
  8 up to `max_batch_size`). A call with batch b copies its batched inputs into static buffers,
  replays the smallest bucket >= b and returns the first b rows of each output. The padding rows
  (b up to the bucket) hold whatever an earlier call left there, zeros at first: fn must treat
  rows independently (row i of every output depends only on row i of the batched inputs), which
  holds for inference layers but not for, say, a softmax over the batch dimension.
- Arguments. Every tensor argument is batched along dim 0 unless it is marked static
  (`static_argnums`, `static_argnames`); a static tensor (weights, a KV cache) is bound by
  address: the graphs read whatever it holds at replay, so update it in place, never rebind it.
  Arguments that are not tensors are baked into the graphs as constants.
- Capture is lazy: the first call on CUDA tensors warms fn up for every bucket on a side stream,
  then captures every bucket, largest first, into ONE shared memory pool (a smaller bucket reuses
  the blocks a larger one freed). That call's argument signature (shapes other than dim 0,
  dtypes, devices, static addresses, constants) is the one the graphs serve. `.stats` then holds
  the capture time and the memory the graphs hold.
- Outputs are views into the graphs' static buffers: the next call in the same bucket overwrites
  them, and a call in another bucket may (the buckets share one pool). Clone what you keep, or
  pass `copy_outputs=True` to get fresh tensors each call.
- Fallback. A call runs fn eagerly, with one warning per cause, when its batch is above the
  largest bucket, when a tensor is not on CUDA, when autograd would need to record it, or when its
  signature differs from the captured one.
- fn is captured and replayed without autograd, for inference under torch.no_grad() or
  torch.inference_mode(): outputs never carry a grad_fn.

Code that cannot be captured (a host sync such as `.item()`, a copy from host memory, an op whose
output size depends on data) fails at capture with `GraphCaptureError`, which names the likely
problem and the fix and chains the raw CUDA error.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from fuselab.device import recover_from_failed_capture

DEFAULT_MAX_BATCH_SIZE = 64

# Eager calls per bucket before capture: the first triggers lazy initialization (cuBLAS handles
# and workspaces, Triton compilation and autotuning); the later ones let the caching allocator
# settle, so capture records only kernels.
_WARMUP_CALLS = 3


class GraphCaptureError(RuntimeError):
    """fn could not be captured into a CUDA graph; the message says why and what to change."""


class GraphFallbackWarning(UserWarning):
    """A graphed callable ran eagerly; given once per cause and callable."""


# --------------------------------------------------------------------------------------------
# Buckets
# --------------------------------------------------------------------------------------------


def default_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch_size, which is always the last bucket.

    Powers of two keep tiny batches cheap; steps of 8 above that bound the padding waste to 7 rows
    while keeping the number of graphs (and the capture time) linear in the maximum.
    """
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch_size]
    buckets += range(16, max_batch_size + 1, 8)
    if buckets[-1] != max_batch_size:
        buckets.append(max_batch_size)
    return tuple(buckets)


def validate_buckets(batch_sizes: Iterable[int]) -> tuple[int, ...]:
    """The given batch sizes, sorted and without repeats; ValueError/TypeError for a bad list."""
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Iterable):
        raise TypeError(f"batch_sizes must be an iterable of positive ints, got {type(batch_sizes).__name__}")
    sizes = list(batch_sizes)
    if not sizes:
        raise ValueError("batch_sizes must name at least one batch size, got an empty list")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"batch_sizes must hold positive ints, got {size!r} in {sizes}")
    return tuple(sorted(set(sizes)))


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= batch, or None when batch is above the largest bucket."""
    index = bisect.bisect_left(buckets, batch)
    return buckets[index] if index < len(buckets) else None


# --------------------------------------------------------------------------------------------
# Call signatures and the fallback decision
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArgSpec:
    """What the graphs depend on in one argument; key is a position (int) or a keyword (str)."""

    key: int | str
    kind: str  # "batched", "static" or "constant"
    shape: tuple[int, ...] = ()  # batched: the shape after dim 0; static: the whole shape
    stride: tuple[int, ...] = ()  # static only: a view with other strides reads other elements
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    address: int | None = None  # static only: where the graphs read it
    value: Any = None  # constants only


@dataclass(frozen=True)
class CallSignature:
    batch: int
    args: tuple[ArgSpec, ...]
    needs_grad: bool  # autograd would record this call eagerly


@dataclass(frozen=True)
class Fallback:
    """Why a call runs eagerly: `cause` is one of device, autograd, batch, signature."""

    cause: str
    detail: str


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False


def describe_call(args: tuple, kwargs: dict, static_keys: frozenset) -> CallSignature:
    """The signature of a call: batched tensors, static tensors, constants, and the batch size."""
    specs: list[ArgSpec] = []
    batch: int | None = None
    batch_key: int | str | None = None
    needs_grad = False
    for key, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, torch.Tensor):
            needs_grad = needs_grad or value.requires_grad
            if key in static_keys:
                specs.append(ArgSpec(key, "static", tuple(value.shape), value.stride(), value.dtype, value.device, value.data_ptr()))
                continue
            if value.dim() == 0:
                raise ValueError(f"graphed: argument {key!r} is a 0-dim tensor, so it has no batch dimension; mark it static")
            if batch is None:
                batch, batch_key = value.shape[0], key
            elif value.shape[0] != batch:
                raise ValueError(
                    f"graphed: batched arguments disagree on dim 0: {batch_key!r} has {batch} rows, {key!r} has "
                    f"{value.shape[0]}; mark tensors without a batch dimension static (static_argnums/static_argnames)"
                )
            specs.append(ArgSpec(key, "batched", tuple(value.shape[1:]), dtype=value.dtype, device=value.device))
        elif _holds_tensor(value):
            raise TypeError(f"graphed: argument {key!r} holds tensors inside a container; pass each tensor as its own argument")
        else:
            specs.append(ArgSpec(key, "constant", value=value))
    if batch is None:
        raise TypeError("graphed: the call has no batched tensor argument (every tensor is marked static)")
    return CallSignature(batch, tuple(specs), needs_grad and torch.is_grad_enabled())


def _same_constant(a: Any, b: Any) -> bool:
    # Types too: x * 1 and x * 1.0 capture different kernels on integer tensors.
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except (TypeError, ValueError, RuntimeError):  # values whose == is not a plain truth value
        return False


def _signature_difference(captured: CallSignature, call: CallSignature) -> str | None:
    old_keys, new_keys = [s.key for s in captured.args], [s.key for s in call.args]
    if old_keys != new_keys:
        return f"the arguments given changed from {old_keys} to {new_keys}"
    for old, new in zip(captured.args, call.args):
        name = f"argument {old.key!r}"
        if old.kind != new.kind:
            return f"{name} changed from {old.kind} to {new.kind}"
        if old.kind == "constant":
            if not _same_constant(old.value, new.value):
                return f"{name} changed from {old.value!r} to {new.value!r}, but constants are baked into the graphs"
            continue
        for what in ("shape", "dtype", "device", "stride", "address"):
            if getattr(old, what) != getattr(new, what):
                hint = "; static tensors are bound by address: update them in place" if old.kind == "static" else ""
                label = "shape after dim 0" if (old.kind, what) == ("batched", "shape") else what
                return f"{name} {label} changed from {getattr(old, what)} to {getattr(new, what)}{hint}"
    return None


def fallback_reason(call: CallSignature, captured: CallSignature | None, largest_bucket: int) -> Fallback | None:
    """Why this call must run eagerly, or None when the graphs can serve it."""
    for spec in call.args:
        if spec.device is not None and spec.device.type != "cuda":
            return Fallback("device", f"argument {spec.key!r} is on {spec.device}; CUDA graphs replay only CUDA tensors")
    if call.needs_grad:
        return Fallback("autograd", "a tensor argument requires grad while grad is enabled; graphs replay without autograd")
    if call.batch > largest_bucket:
        return Fallback("batch", f"batch {call.batch} is above the largest captured bucket, {largest_bucket}")
    if captured is not None:
        difference = _signature_difference(captured, call)
        if difference is not None:
            return Fallback("signature", difference + " since capture")
    return None


# --------------------------------------------------------------------------------------------
# Capture errors
# --------------------------------------------------------------------------------------------

_HOST_SYNC_MARKS = (
    "when stream is capturing",  # CUDA's "operation not permitted when stream is capturing"
    "previous error during capture",  # what capture_end says afterwards
    "capture invalidated",
    "cudaerrorstreamcapture",
)


def explain_capture_error(err: BaseException, fn_name: str, bucket: int) -> str:
    """A message naming the likely cause of a failed capture and its fix, from the raw error chain."""
    chain: list[BaseException] = []
    cause: BaseException | None = err
    while cause is not None and cause not in chain:  # a failed capture_end raises while handling fn's error
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    text = " | ".join(str(e) for e in chain).lower()
    root = str(chain[-1]).strip().splitlines()[0] if str(chain[-1]).strip() else type(chain[-1]).__name__
    if any(mark in text for mark in _HOST_SYNC_MARKS):
        problem = (
            "fn waits for the GPU or reads host memory while being captured: .item(), .cpu(), .tolist(), "
            "printing a tensor, `if tensor:`, a CPU tensor copied to the GPU, or an op whose output size "
            "depends on data (nonzero, masked_select, boolean indexing, unique)"
        )
        fix = (
            "keep the values on the GPU (torch.where instead of branching on a value), create constant "
            "tensors on the GPU outside fn and pass them as static arguments, and compute data-dependent "
            "sizes before the call"
        )
    elif "out of memory" in text:
        problem = "the GPU ran out of memory while capturing the buckets"
        fix = "lower max_batch_size or pass fewer batch_sizes"
    elif "expected all tensors to be on the same device" in text:
        problem = "fn mixes a CPU tensor into GPU work"
        fix = "move that tensor to the GPU once, outside fn, and pass it as a static argument"
    else:
        problem = "fn does something CUDA graphs cannot record"
        fix = "find the failing op in the chained error below; run fn eagerly if it cannot be changed"
    return f"graphed: capturing {fn_name} at batch size {bucket} failed: {problem}. Fix: {fix}. (CUDA said: {root})"


# --------------------------------------------------------------------------------------------
# The graphed callable
# --------------------------------------------------------------------------------------------


@dataclass
class GraphStats:
    """What capture cost and what the graphs hold; counts of replayed and eager calls."""

    buckets: tuple[int, ...] = ()
    captured: bool = False
    capture_s: float = 0.0  # warm-up and capture of every bucket
    pool_reserved_bytes: int = 0  # memory the shared pool reserved: what other work cannot use
    pool_allocated_bytes: int = 0  # of which live: every bucket's static outputs
    input_buffer_bytes: int = 0  # the static input buffers, sized for the largest bucket
    replays: int = 0
    eager_calls: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)  # eager calls by cause

    @property
    def held_bytes(self) -> int:
        """GPU memory the graphs keep from other work: the pool and the input buffers."""
        return self.pool_reserved_bytes + self.input_buffer_bytes


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], out: Any, path: str = "output") -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, dict):
        return {k: _map_tensors(fn, v, f"{path}[{k!r}]") for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        items = [_map_tensors(fn, v, f"{path}[{i}]") for i, v in enumerate(out)]
        if hasattr(out, "_fields"):  # a namedtuple
            return type(out)(*items)
        return type(out)(items)
    raise GraphCaptureError(
        f"graphed: {path} is a {type(out).__name__}; fn must return a tensor or a tuple/list/dict of tensors"
    )


def _static_keys(fn: Callable, static_argnums: Iterable[int], static_argnames: Iterable[str]) -> frozenset:
    """Positions and names of static arguments; through fn's signature a mark covers both spellings."""
    nums, names = set(static_argnums), set(static_argnames)
    for n in nums:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"static_argnums must hold non-negative ints, got {n!r}")
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"static_argnames must hold strings, got {name!r}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature: keep the marks as given
        return frozenset(nums | names)
    kinds = {p.kind for p in params}
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        unknown = names - {p.name for p in params if p.kind != inspect.Parameter.POSITIONAL_ONLY}
        if unknown:
            raise ValueError(f"static_argnames names no parameter of fn: {sorted(unknown)}")
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if inspect.Parameter.VAR_POSITIONAL not in kinds and any(n >= len(positional) for n in nums):
        raise ValueError(f"static_argnums {sorted(nums)} out of range: fn takes {len(positional)} positional arguments")
    for index, p in enumerate(positional):
        if index in nums and p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD:
            names.add(p.name)
        if p.name in names:
            nums.add(index)
    return frozenset(nums | names)


class GraphedCallable:
    """fn captured per bucket; call it like fn. See the module docstring for the contract."""

    def __init__(self, fn: Callable, buckets: tuple[int, ...], static_keys: frozenset, copy_outputs: bool):
        functools.update_wrapper(self, fn, updated=())  # name, doc and signature; never fn's __dict__
        self.fn = fn
        self.buckets = buckets
        self.copy_outputs = copy_outputs
        self.stats = GraphStats(buckets=buckets)
        self._static_keys = static_keys
        self._name = getattr(fn, "__qualname__", type(fn).__name__)
        self._signature: CallSignature | None = None
        self._capture_args: tuple = ()  # the first call's arguments: keeps static tensors alive
        self._capture_kwargs: dict = {}
        self._inputs: dict[int | str, torch.Tensor] = {}  # static input buffers, largest bucket rows
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._warned: set[str] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = describe_call(args, kwargs, self._static_keys)
        reason = fallback_reason(call, self._signature, self.buckets[-1])
        if reason is not None:
            return self._run_eagerly(reason, args, kwargs)
        if self._signature is None:
            self._capture(call, args, kwargs)
        return self._replay(call.batch, args, kwargs)

    def _run_eagerly(self, reason: Fallback, args: tuple, kwargs: dict) -> Any:
        if reason.cause not in self._warned:
            self._warned.add(reason.cause)
            warnings.warn(
                f"graphed({self._name}) runs eagerly: {reason.detail}. Said once; later calls with this cause "
                "run eagerly without a warning.",
                GraphFallbackWarning,
                stacklevel=3,
            )
        self.stats.eager_calls += 1
        self.stats.fallbacks[reason.cause] = self.stats.fallbacks.get(reason.cause, 0) + 1
        return self.fn(*args, **kwargs)

    def _bucket_call(self, bucket: int) -> Any:
        """fn on the first `bucket` rows of the static input buffers."""
        args = [self._inputs[i][:bucket] if i in self._inputs else a for i, a in enumerate(self._capture_args)]
        kwargs = {k: self._inputs[k][:bucket] if k in self._inputs else v for k, v in self._capture_kwargs.items()}
        return self.fn(*args, **kwargs)

    def _capture(self, call: CallSignature, args: tuple, kwargs: dict) -> None:
        batched = {s.key: (args[s.key] if isinstance(s.key, int) else kwargs[s.key]) for s in call.args if s.kind == "batched"}
        device = next(iter(batched.values())).device
        largest = self.buckets[-1]
        # Outside inference mode even when called inside it: inference tensors as static buffers would
        # refuse the in-place copies of calls made outside it.
        with torch.cuda.device(device), torch.inference_mode(False), torch.no_grad():
            torch.cuda.synchronize()
            start = time.perf_counter()
            # Keep static tensors and constants alive for the graphs, not the caller's batched inputs.
            self._capture_args = tuple(None if i in batched else a for i, a in enumerate(args))
            self._capture_kwargs = {k: None if k in batched else v for k, v in kwargs.items()}
            self._inputs = {key: torch.zeros((largest, *t.shape[1:]), dtype=t.dtype, device=device) for key, t in batched.items()}
            for key, t in batched.items():  # warm up on real rows; the padding rows stay zero
                self._inputs[key][: t.shape[0]].copy_(t)

            # Warm-up and capture share one side stream: capture must not run on the legacy default
            # stream, and per-stream state (the cuBLAS workspace) is then created before capture.
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for bucket in reversed(self.buckets):
                    for _ in range(_WARMUP_CALLS):
                        self._bucket_call(bucket)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # so the deltas below count the graphs' pool, not warm-up leftovers
            reserved_before = torch.cuda.memory_reserved(device)
            allocated_before = torch.cuda.memory_allocated(device)

            pool = torch.cuda.graph_pool_handle()
            caller_stream = torch.cuda.current_stream(device)
            graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
            for bucket in reversed(self.buckets):  # largest first: smaller ones reuse its freed blocks
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        out = self._bucket_call(bucket)
                except Exception as err:
                    recover_from_failed_capture(caller_stream)
                    self._inputs, self._capture_args, self._capture_kwargs = {}, (), {}
                    raise GraphCaptureError(explain_capture_error(err, self._name, bucket)) from err
                _map_tensors(functools.partial(self._check_output_rows, bucket), out)
                graphs[bucket] = (graph, out)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

            self._graphs = graphs
            self._signature = call
            self.stats.captured = True
            self.stats.capture_s = time.perf_counter() - start
            self.stats.pool_reserved_bytes = torch.cuda.memory_reserved(device) - reserved_before
            self.stats.pool_allocated_bytes = torch.cuda.memory_allocated(device) - allocated_before
            self.stats.input_buffer_bytes = sum(t.numel() * t.element_size() for t in self._inputs.values())

    def _check_output_rows(self, bucket: int, t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != bucket:
            raise GraphCaptureError(
                f"graphed: {self._name} returned a tensor of shape {tuple(t.shape)} at batch size {bucket}; "
                "every output must have the batch as dim 0, because a call returns its first b rows"
            )
        return t

    def _replay(self, batch: int, args: tuple, kwargs: dict) -> Any:
        bucket = bucket_for(batch, self.buckets)
        for key, buffer in self._inputs.items():
            buffer[:batch].copy_(args[key] if isinstance(key, int) else kwargs[key])
        graph, out = self._graphs[bucket]
        graph.replay()
        self.stats.replays += 1
        if self.copy_outputs:
            return _map_tensors(lambda t: t[:batch].clone(), out)
        return _map_tensors(lambda t: t[:batch], out)


def graphed(
    fn: Callable,
    *,
    batch_sizes: Iterable[int] | None = None,
    max_batch_size: int | None = None,
    static_argnums: Iterable[int] = (),
    static_argnames: Iterable[str] = (),
    copy_outputs: bool = False,
) -> GraphedCallable:
    """Wrap fn so that calls replay CUDA graphs captured per batch-size bucket.

    Args:
        fn: the callable (a function or an nn.Module); its tensor arguments are batched along dim 0.
        batch_sizes: the buckets to capture; default `default_buckets(max_batch_size)`.
        max_batch_size: the largest bucket when batch_sizes is not given (default 64).
        static_argnums, static_argnames: arguments that are not batched (weights, caches), bound
            by address. A mark by position also covers the same parameter passed by keyword.
        copy_outputs: return fresh tensors instead of views that the next call overwrites.

    Returns a callable with fn's signature and a `.stats` (GraphStats). Capture happens on the
    first call with CUDA tensors; see the module docstring for the full contract.
    """
    if not callable(fn):
        raise TypeError(f"graphed: fn must be callable, got {type(fn).__name__}")
    if batch_sizes is not None and max_batch_size is not None:
        raise ValueError("graphed: give batch_sizes or max_batch_size, not both")
    if not isinstance(copy_outputs, bool):
        raise TypeError(f"graphed: copy_outputs must be a bool, got {copy_outputs!r}")
    if batch_sizes is not None:
        buckets = validate_buckets(batch_sizes)
    else:
        buckets = default_buckets(DEFAULT_MAX_BATCH_SIZE if max_batch_size is None else max_batch_size)
    return GraphedCallable(fn, buckets, _static_keys(fn, static_argnums, static_argnames), copy_outputs)
