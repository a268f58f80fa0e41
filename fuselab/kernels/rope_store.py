"""RoPE and the KV-cache store in one launch, for inference: `rope_and_store_kv`.

Each program rotates its token's queries and keys as apply_rope does (rope.py) and also writes the
rotated keys and its values into a paged KV cache (see attention/paged_attention.py), so a layer
launches one kernel where apply_rope then store_kv launch two. Inputs of any layout take rope.py's
kernel with its store turned on (a constexpr flag; with it off, apply_rope's kernel compiles as it
always has). Inputs laid out as a decode step's are (q, k, v views of one projection, dense caches)
take `_rope_store_kernel`, the same work with the strides that follow from the shapes compiled in:
15 launch arguments instead of 39, each of which costs host time in the launcher.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fuselab.kernels._common import indices
from fuselab.kernels._common.fast_launch import prepare
from fuselab.kernels._common.launch import use_pdl
from fuselab.kernels._common.validate import (
    FLOAT_DTYPES,
    check_flag,
    check_float_tensor,
    needs_autograd,
    on_kernel_device,
)
from fuselab.kernels.attention.paged_attention import _caches_ok, _check_caches, check_store_inputs, store_inputs_ok
from fuselab.kernels.rope import (
    _MANY_TOKENS, _copy_heads, _launch_rope, _rope_meta, _rotate_heads, cos_sin_at, token_rows)
from fuselab.kernels.rope_checks import _POSITION_DTYPES, LAYOUTS, _check_inputs, _inputs_ok, tokens_apart


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr,
    k_cache_ptr, v_cache_ptr, q_stride_t, k_stride_t, v_stride_t, max_pos, num_slots,
    N_Q_HEADS: tl.constexpr, N_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_V_HEADS: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
    IN_PLACE: tl.constexpr = False,
):
    # _rope_kernel with the store, for the layout a decode step has (_decode_layout_ok): heads HEAD_DIM
    # apart in q, k and v, dense outputs, caches, positions, slots and cos/sin table. Every stride but
    # the tokens' follows from the constexprs, so a launch passes 15 arguments instead of 39 (each
    # costs host time in the launcher). A dense cache's slot s starts at element s · kv_heads · head_dim.
    # IN_PLACE: the rotated q and k overwrite the inputs (q_out_ptr and k_out_ptr are not read); each
    # element is loaded and stored by the same thread, and a program touches its own token only.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos, sin = cos_sin_at(cos_sin_ptr, pos, max_pos, 2 * HALF, HALF, BLOCK_HALF)
    q_src, k_src, q_dst, k_dst = token_rows(q_ptr, k_ptr, q_out_ptr, k_out_ptr, token, q_stride_t, k_stride_t,
                                            N_Q_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM, IN_PLACE)
    _rotate_heads(
        q_src, HEAD_DIM, q_dst, HEAD_DIM,
        N_Q_HEADS, cos, sin, q_dst, 0, False,
        HALF, BLOCK_HALF, BLOCK_Q_HEADS, HEAD_DIM, BLOCK_PASS, INTERLEAVED, False,
    )
    # Slot -1 (padding) or one outside the cache: rotated into the outputs, nothing stored.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    stored = (slot >= 0) & (slot < num_slots)
    n_cache_heads = tl.where(stored, N_KV_HEADS, 0)
    cache_offset = tl.where(stored, slot, 0) * (N_KV_HEADS * HEAD_DIM)
    _rotate_heads(
        k_src, HEAD_DIM, k_dst, HEAD_DIM,
        N_KV_HEADS, cos, sin, k_cache_ptr + cache_offset, HEAD_DIM, n_cache_heads,
        HALF, BLOCK_HALF, BLOCK_K_HEADS, HEAD_DIM, BLOCK_PASS, INTERLEAVED, True,
    )
    _copy_heads(v_ptr + token * v_stride_t, HEAD_DIM, v_cache_ptr + cache_offset, HEAD_DIM, n_cache_heads,
                BLOCK_V_HEADS, HEAD_DIM, BLOCK_D)


@functools.cache
def _rope_store_launcher(head_dim: int, rotary_dim: int, q_heads: int, kv_heads: int, interleaved: bool,
                         many_tokens: bool, pdl: bool, in_place: bool) -> Callable[..., None]:
    """_rope_store_kernel with its compile-time arguments and launch options, once per shape."""
    meta = _rope_meta(head_dim, rotary_dim, q_heads, kv_heads, interleaved, False, kv_heads, 1, many_tokens)
    return prepare(_rope_store_kernel, N_Q_HEADS=q_heads, N_KV_HEADS=kv_heads, HALF=meta["HALF"],
                   BLOCK_HALF=meta["BLOCK_HALF"], BLOCK_Q_HEADS=meta["BLOCK_Q_HEADS"],
                   BLOCK_K_HEADS=meta["BLOCK_K_HEADS"], HEAD_DIM=head_dim, BLOCK_PASS=meta["BLOCK_PASS"],
                   INTERLEAVED=interleaved, BLOCK_V_HEADS=meta["BLOCK_V_HEADS"], BLOCK_D=meta["BLOCK_D"],
                   USE_PDL=pdl, IN_PLACE=in_place, launch_pdl=pdl)


def _launch_rope_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, interleaved: bool,
                       inplace: bool):
    """rope_and_store_kv's launch for inputs of the decode layout (_decode_layout_ok)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if inplace:
        q_out, k_out = q, k
    else:
        q_out, k_out = q.new_empty(tokens, q_heads, head_dim), k.new_empty(tokens, kv_heads, head_dim)
    if tokens == 0:
        return q_out, k_out
    cache_shape, cos_sin_shape = k_cache.shape, cos_sin.shape
    pdl = use_pdl(q.device)
    launcher = _rope_store_launcher(head_dim, cos_sin_shape[1], q_heads, kv_heads, interleaved, tokens >= _MANY_TOKENS,
                                    pdl, inplace)
    # In place the output pointers are not read: None costs the launcher less than a tensor.
    launcher((tokens,),
        q, k, v, None if inplace else q_out, None if inplace else k_out, positions, cos_sin, slot_mapping,
        k_cache, v_cache,
        q.stride()[0], k.stride()[0], v.stride()[0], cos_sin_shape[0], cache_shape[0] * cache_shape[1],
    )
    return q_out, k_out


_Tensor = torch.Tensor


def _decode_layout_ok(q: object, k: object, v: object, positions: object, cos_sin: object, k_cache: object,
                      v_cache: object, slot_mapping: object, layout: object) -> bool:
    """rope_and_store_kv's checks would pass and the inputs have a decode step's layout, which
    _rope_store_kernel takes: q, k, v [tokens, heads, head_dim] with heads head_dim apart (views of one
    projection are), dense caches, 1-D dense positions and slots, a dense cos/sin table. One pass."""
    if not (isinstance(q, _Tensor) and isinstance(k, _Tensor) and isinstance(v, _Tensor)
            and isinstance(positions, _Tensor) and isinstance(cos_sin, _Tensor) and isinstance(k_cache, _Tensor)
            and isinstance(v_cache, _Tensor) and isinstance(slot_mapping, _Tensor)):
        return False
    q_shape, k_shape, v_shape, cache_shape, cos_sin_shape = q.shape, k.shape, v.shape, k_cache.shape, cos_sin.shape
    if len(q_shape) != 3 or len(k_shape) != 3 or len(v_shape) != 3 or len(cache_shape) != 4:
        return False
    tokens, _, head_dim = q_shape
    kv_heads, block_size, dtype, device = k_shape[1], cache_shape[1], k.dtype, q.get_device()
    q_stride, k_stride, v_stride = q.stride(), k.stride(), v.stride()
    return (layout in LAYOUTS and q.dtype in FLOAT_DTYPES and dtype in FLOAT_DTYPES and on_kernel_device(q)
            and v.dtype is dtype and k_cache.dtype is dtype and v_cache.dtype is dtype
            and cos_sin.dtype in FLOAT_DTYPES and positions.dtype in _POSITION_DTYPES
            and slot_mapping.dtype is torch.int32
            and k_shape[0] == tokens and v_shape[0] == tokens and k_shape[2] == head_dim and v_shape[2] == head_dim
            and v_shape[1] == kv_heads and cache_shape[2] == kv_heads and cache_shape[3] == head_dim
            and v_cache.shape == cache_shape and block_size >= 1 and not block_size & (block_size - 1)
            and q_stride[2] == 1 and k_stride[2] == 1 and v_stride[2] == 1
            and q_stride[1] == head_dim and k_stride[1] == head_dim and v_stride[1] == head_dim
            and positions.shape == (tokens,) and slot_mapping.shape == (tokens,)
            and positions.is_contiguous() and slot_mapping.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous() and cos_sin.is_contiguous()
            and len(cos_sin_shape) == 2 and cos_sin_shape[1] % 2 == 0 and 0 < cos_sin_shape[1] <= head_dim
            and on_kernel_device(k) and on_kernel_device(v) and on_kernel_device(positions)
            and on_kernel_device(cos_sin) and on_kernel_device(k_cache) and on_kernel_device(v_cache)
            and on_kernel_device(slot_mapping)  # the device type, then (for CUDA) which device
            and k.get_device() == device and v.get_device() == device and positions.get_device() == device
            and cos_sin.get_device() == device and k_cache.get_device() == device
            and v_cache.get_device() == device and slot_mapping.get_device() == device)


def _check_store_inputs(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, layout) -> None:
    """rope_and_store_kv's checks, one by one."""
    _check_inputs(q, k, positions, cos_sin, layout)
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim] to store into the cache, got shape {tuple(q.shape)}")
    check_store_inputs(k, v, k_cache, v_cache, slot_mapping)
    for name, t, cache_name, cache in (("k", k, "k_cache", k_cache), ("v", v, "v_cache", v_cache)):
        if cache.dtype != t.dtype:
            raise TypeError(f"{cache_name} has dtype {cache.dtype} but {name} has dtype {t.dtype}")
    if v.stride(-1) != 1:
        raise ValueError("v must have a contiguous last (head_dim) dimension; other strides may be anything")


def rope_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: str = "rotate_half",
    *,
    inplace: bool = False,
    check_indices: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope` and `store_kv` in one launch: rotates q [tokens, q_heads, head_dim] and
    k [tokens, kv_heads, head_dim] as apply_rope does and returns the new (q, k), while writing
    token t's rotated k and its v (unchanged) into slot slot_mapping[t] = block · block_size + offset
    of k_cache and v_cache [num_blocks, block_size, kv_heads, head_dim], in place; slot -1 (padding)
    writes nothing, and so does any other slot outside the cache. q, k and v may be strided views
    of one fused projection (unit last stride). The caches must have k's and v's dtype.
    check_indices=True (default: the FUSELAB_CHECK_INDICES environment variable) checks positions
    and slot_mapping on the host first, as apply_rope and store_kv do.

    inplace=True rotates q and k where they lie and returns them: no new tensors, two allocations
    fewer a call (what an engine wants of the projection's output, read by nothing else). q, k and v
    must not share memory then (views of one projection do not); a ValueError says so otherwise.

    Inference only: it writes the cache and records no gradients, so it refuses inputs that
    require grad while grad mode is on (use apply_rope and store_kv there, or torch.no_grad()).
    """
    decode_layout = _decode_layout_ok(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, layout)
    if not decode_layout and not (
            _inputs_ok(q, k, positions, cos_sin, layout) and q.dim() == 3
            and store_inputs_ok(k, v, k_cache, v_cache, slot_mapping) and k_cache.dtype is k.dtype
            and v_cache.dtype is v.dtype and v.stride()[-1] == 1):
        _check_store_inputs(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, layout)
    if needs_autograd(q, k, v):
        raise RuntimeError(
            "rope_and_store_kv is not differentiable (it is for inference): q, k or v requires grad; "
            "call it under torch.no_grad() or torch.inference_mode(), or use apply_rope and store_kv"
        )
    if inplace is not False:
        check_flag("inplace", inplace)
        # One token of the decode layout (an engine's batch-1 step) needs its three runs' pointers only.
        if not (_one_token_apart(q, k, v) if decode_layout and q.shape[0] == 1 else _separate(q, k, v)):
            raise ValueError("inplace=True needs q, k and v in separate memory (views of one projection are): "
                             "rotating q or k in place could change another input")
    if indices.requested(check_indices, q.device):
        indices.check_positions(positions, cos_sin.shape[0])
        indices.check_slot_mapping(slot_mapping, k_cache.shape[0], k_cache.shape[1])
    if decode_layout:
        return _launch_rope_store(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                                  layout == "interleaved", inplace)
    q_out, k_out = _launch_rope(q, k, positions, cos_sin, layout == "interleaved", inverse=False,
                                store=(v, k_cache, v_cache, slot_mapping))
    if inplace:  # other layouts: out of place, then copied back
        return q.copy_(q_out), k.copy_(k_out)
    return q_out, k_out


def _one_token_apart(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """_separate for one token of the decode layout (k and v alike, each token's heads one dense run)."""
    q_shape, k_shape, size = q.shape, k.shape, q.element_size()
    q_run, kv_run = q_shape[1] * q_shape[2] * size, k_shape[1] * k_shape[2] * size
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    return ((qp + q_run <= kp or kp + kv_run <= qp) and (qp + q_run <= vp or vp + kv_run <= qp)
            and (kp + kv_run <= vp or vp + kv_run <= kp))


def _separate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether no two of q, k, v [tokens, heads, head_dim] share an element (`rope.tokens_apart`, pairwise):
    separate tensors, or views of one projection whose runs lie apart within one token stride."""
    return tokens_apart(q, k) and tokens_apart(q, v) and tokens_apart(k, v)


_POSITION_DTYPE_SET = frozenset(_POSITION_DTYPES)
_INT32 = torch.int32


class BoundRopeAndStoreKV:
    """`rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, layout,
    inplace=inplace)` as `bound(q, k, v, positions, slot_mapping, inplace=False)`; made by
    `bind_rope_and_store_kv`."""

    def __init__(self, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        check_float_tensor("cos_sin", cos_sin)
        shape = cos_sin.shape
        if len(shape) != 2 or shape[1] % 2 or shape[1] == 0 or cos_sin.stride()[-1] != 1:
            raise ValueError(f"cos_sin must be [max_pos, rotary_dim] with an even rotary_dim and a contiguous last "
                             f"dimension, got shape {tuple(shape)}")
        if not _caches_ok(k_cache, v_cache):
            _check_caches(k_cache, v_cache)
        if cos_sin.device != k_cache.device:
            raise ValueError(f"cos_sin is on {cos_sin.device} but k_cache is on {k_cache.device}")
        self.cos_sin, self.k_cache, self.v_cache, self.layout = cos_sin, k_cache, v_cache, layout
        _, _, self._kv_heads, self._head_dim = k_cache.shape
        self._dtype, self._device, self._device_index = k_cache.dtype, k_cache.device, k_cache.get_device()
        # The decode layout's kernel also needs every bound tensor dense; else each call takes the general path.
        self._dense = (cos_sin.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
                       and shape[1] <= self._head_dim)
        self._num_slots = k_cache.shape[0] * k_cache.shape[1]
        self._launchers: dict[tuple, Callable[..., None]] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """rope_and_store_kv of these q, k, v [tokens, heads, head_dim] into the bound cache."""
        if (self._dense and isinstance(q, _Tensor) and isinstance(k, _Tensor) and isinstance(v, _Tensor)
                and isinstance(positions, _Tensor) and isinstance(slot_mapping, _Tensor)
                and (inplace is False or inplace is True) and not indices.CHECK_BY_DEFAULT):
            q_shape, k_shape, pdl = q.shape, k.shape, use_pdl(self._device)
            launcher = self._launchers.get((q_shape, k_shape, pdl, inplace))
            if launcher is None:
                launcher = self._launcher(q, k, v, positions, slot_mapping, pdl, inplace)
            if launcher is not None:
                dtype, head_dim, device = self._dtype, self._head_dim, self._device_index
                q_stride, k_stride, v_stride = q.stride(), k.stride(), v.stride()
                tokens = q_shape[:1]
                # The launcher's shapes were checked when it was made: what is left is what a shape does not say.
                if (q.dtype is dtype and k.dtype is dtype and v.dtype is dtype and v.shape == k_shape
                        and q_stride[2] == 1 and k_stride[2] == 1 and v_stride[2] == 1 and q_stride[1] == head_dim
                        and k_stride[1] == head_dim and v_stride[1] == head_dim
                        and positions.dtype in _POSITION_DTYPE_SET and slot_mapping.dtype is _INT32
                        and positions.shape == tokens and slot_mapping.shape == tokens
                        and positions.is_contiguous() and slot_mapping.is_contiguous()
                        and on_kernel_device(q) and on_kernel_device(k) and on_kernel_device(v)
                        and on_kernel_device(positions) and on_kernel_device(slot_mapping)
                        and q.get_device() == device and k.get_device() == device and v.get_device() == device
                        and positions.get_device() == device and slot_mapping.get_device() == device
                        and not needs_autograd(q, k, v)
                        and (not inplace or (_one_token_apart(q, k, v) if tokens[0] == 1 else _separate(q, k, v)))):
                    q_out, k_out = (None, None) if inplace else (q.new_empty(q_shape), k.new_empty(k_shape))
                    launcher((tokens[0],), q, k, v, q_out, k_out, positions, self.cos_sin, slot_mapping,
                             self.k_cache, self.v_cache, q_stride[0], k_stride[0], v_stride[0],
                             self.cos_sin.shape[0], self._num_slots)
                    return (q, k) if inplace else (q_out, k_out)
        return rope_and_store_kv(q, k, v, positions, self.cos_sin, self.k_cache, self.v_cache, slot_mapping,
                                 self.layout, inplace=inplace)

    def _launcher(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, pdl: bool, inplace: bool) -> Callable[..., None] | None:
        """The launcher of these inputs' shapes, kept for later calls, where they are the decode layout and
        hold at least one token; else None (rope_and_store_kv's general path, or its errors)."""
        if not _decode_layout_ok(q, k, v, positions, self.cos_sin, self.k_cache, self.v_cache, slot_mapping,
                                 self.layout) or q.shape[0] == 0:
            return None
        tokens, q_heads, head_dim = q.shape
        launcher = _rope_store_launcher(head_dim, self.cos_sin.shape[1], q_heads, self._kv_heads,
                                        self.layout == "interleaved", tokens >= _MANY_TOKENS, pdl, inplace)
        self._launchers[(q.shape, k.shape, pdl, inplace)] = launcher
        return launcher


def bind_rope_and_store_kv(cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           layout: str = "rotate_half") -> BoundRopeAndStoreKV:
    """`rope_and_store_kv` with one layer's table and caches fixed and checked now: `bound(q, k, v,
    positions, slot_mapping, inplace=False)` returns what `rope_and_store_kv(q, k, v, positions, cos_sin,
    k_cache, v_cache, slot_mapping, layout, inplace=inplace)` would, for less host time a call (an engine's
    decode step calls it once a layer). Inputs of another layout, or wrong ones, go through
    rope_and_store_kv itself. The bound tensors must keep their shape, dtype and device while it is used."""
    return BoundRopeAndStoreKV(cos_sin, k_cache, v_cache, layout)
