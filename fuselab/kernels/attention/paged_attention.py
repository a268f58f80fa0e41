"""Decode attention over a paged KV cache, and the kernel that writes new keys and values into it.

The cache holds keys (and, separately, values) in fixed-size blocks, [num_blocks, block_size,
kv_heads, head_dim]; sequence i's token t lives in block block_tables[i, t // block_size] at
offset t % block_size. Blocks of a sequence need not be adjacent, so memory is handed out a block
at a time (vLLM's PagedAttention).

`decode_attention` is flash-decoding: one query token per sequence, its context cut into
`num_splits` parts processed by separate programs, each writing a partial output and its
log-sum-exp, which a second launch merges; or, given a buffer of tickets, the program that finishes
last among the splits of a sequence's key/value head (its ticket tells it) merges them in the same
launch. A context in one part, as at large batches, is written as the output directly. The query heads that share a key/value head are
one [group, head_dim] tile, so each key and value is read once for the whole group. Everything sized
on the host comes from shapes and arguments, never from seq_lens' values: no host sync, no
data-dependent allocation, so a captured CUDA graph replays it with new seq_lens.

Its kernels are in paged_decode_kernels.py. Dense inputs (an engine's decode step) in one launch,
given tickets or in one split, take the one whose strides follow from the shapes: fewer launch
arguments, and the partials in the output's allocation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fuselab.kernels.attention.common import (
    LOG2E,
    SUPPORTED_HEAD_DIMS,
    dot_precision,
    padded_head_dim,
    resolve_scale,
)
from fuselab.kernels.attention.paged_decode_kernels import _decode_kernel, _decode_merge_kernel, _dense_decode_kernel
from fuselab.kernels._common import indices
from fuselab.kernels._common.fast_launch import launch, prepare
from fuselab.kernels._common.launch import cdiv, next_power_of_2, sm_count, use_pdl
from fuselab.kernels._common.validate import (
    FLOAT_DTYPES,
    INTERPRETED,
    check_counters,
    check_float_tensor,
    check_like,
    counters_ok,
    on_kernel_device,
)

# --------------------------------------------------------------------------------------------
# The cache store's Triton kernel (decode attention's are in paged_decode_kernels.py)
# --------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    K, V, K_CACHE, V_CACHE, SLOT_MAPPING, stride_kt, stride_vt, stride_kc_block, stride_kc_slot,
    stride_vc_block, stride_vc_slot, token_width, num_slots, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per token: its kv_heads · head_dim values are contiguous in the input and in the slot.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOT_MAPPING + token).to(tl.int64)
    # -1: padding of a batch rounded up for a CUDA graph. A slot outside the cache is no store either.
    if (slot < 0) | (slot >= num_slots):
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    cols = tl.arange(0, BLOCK)
    mask = cols < token_width
    k = tl.load(K + token * stride_kt + cols, mask=mask)
    v = tl.load(V + token * stride_vt + cols, mask=mask)
    tl.store(K_CACHE + page * stride_kc_block + offset * stride_kc_slot + cols, k.to(K_CACHE.dtype.element_ty), mask=mask)
    tl.store(V_CACHE + page * stride_vc_block + offset * stride_vc_slot + cols, v.to(V_CACHE.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------


class DecodeConfig(NamedTuple):
    block_n: int  # context tokens per loop step, across page boundaries
    num_warps: int
    num_stages: int


# Hopper, keyed by the head dim rounded up to a power of two. At d=128, two warps over three stages of
# 64-token K and V tiles were the faster on an H200 (docs/tuning/decode_attention-constants.md).
DECODE_CONFIGS: dict[int, DecodeConfig] = {
    16: DecodeConfig(64, 4, 3),
    32: DecodeConfig(64, 4, 3),
    64: DecodeConfig(64, 4, 3),
    128: DecodeConfig(64, 2, 3),
    256: DecodeConfig(32, 4, 3),
}
# A 32-token step crosses a page boundary at block_size 16 and stays inside one at 64.
INTERPRETER_DECODE = DecodeConfig(32, 1, 1)

# Splits shorter than this cost more in fixed work (query load, partial write, merge) than they save.
MIN_TOKENS_PER_SPLIT = 128
# Enough programs to give every SM this many to interleave, so loads stay in flight.
PROGRAMS_PER_SM = 4


def decode_config(head_dim: int) -> DecodeConfig:
    return INTERPRETER_DECODE if INTERPRETED else DECODE_CONFIGS[padded_head_dim(head_dim)]


def num_splits(batch: int, kv_heads: int, max_seq_len: int, max_splits: int, device: torch.device) -> int:
    """How many parts to cut each context into, from static sizes only (so a CUDA graph can hold it).

    As many as fit PROGRAMS_PER_SM programs on every SM in one go, rounded down: a program over
    budget starts a wave of its own and costs a whole part's time (`fuselab bench attention --sweep`).
    """
    sms = sm_count(device)
    to_fill_gpu = PROGRAMS_PER_SM * sms // max(1, batch * kv_heads)
    by_length = cdiv(max(1, max_seq_len), MIN_TOKENS_PER_SPLIT)
    return max(1, min(max_splits, to_fill_gpu, by_length))


def store_kv_launch(k, v, k_cache, v_cache, slot_mapping) -> None:
    k_shape, cache_shape, k_cache_stride, v_cache_stride = k.shape, k_cache.shape, k_cache.stride(), v_cache.stride()
    token_width = k_shape[1] * k_shape[2]
    _store_kv_launcher(cache_shape[1], token_width)((k_shape[0],),
        k, v, k_cache, v_cache, slot_mapping, k.stride()[0], v.stride()[0], k_cache_stride[0], k_cache_stride[1],
        v_cache_stride[0], v_cache_stride[1], token_width, cache_shape[0] * cache_shape[1],
    )


@functools.cache
def _store_kv_launcher(page_size: int, token_width: int) -> Callable[..., None]:
    """The store kernel with its compile-time arguments and launch options, once per cache block and token."""
    return prepare(_store_kv_kernel, PAGE_SIZE=page_size, BLOCK=next_power_of_2(token_width), num_warps=4)


@functools.cache
def _decode_meta(group: int, head_dim: int, page_size: int, dtype: torch.dtype, splits: int, cfg: DecodeConfig,
                 pdl: bool, merge_here: bool) -> dict:
    """The kernel's compile-time arguments and launch options, once per shape and config."""
    return dict(
        GROUP=group, GROUP_PAD=max(16, next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
        PAGE_SIZE=page_size, BLOCK_N=cfg.block_n, DOT_PRECISION=dot_precision(dtype),
        # Two split lanes at least: a one-element reduction axis is an edge case not worth a compiler's risk.
        SPLITS_PAD=max(2, next_power_of_2(splits)), ONE_SPLIT=splits == 1, MERGE_HERE=merge_here, USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )


@functools.cache
def _dense_decode_launcher(group: int, head_dim: int, page_size: int, dtype: torch.dtype, splits: int,
                           cfg: DecodeConfig, pdl: bool, merge_here: bool = True,
                           rope_half: int = 0) -> Callable[..., None]:
    """_dense_decode_kernel with its compile-time arguments and launch options, once per shape and config;
    several splits merge in the launch unless merge_here is False (the merge kernel's, then). rope_half > 0:
    the new-token kernel (rope_decode_attention), its RoPE pairs that far apart."""
    meta = _decode_meta(group, head_dim, page_size, dtype, splits, cfg, pdl, merge_here and splits > 1)
    return prepare(_dense_decode_kernel, NEW_TOKEN=rope_half > 0, HALF=max(1, rope_half), **meta)


def decode_launch(q, k_cache, v_cache, block_tables, seq_lens, scale, splits, counters=None) -> torch.Tensor:
    """The kernels on checked inputs. counters: as decode_attention's (the merge in the splits' launch),
    or None (a second launch merges)."""
    batch, heads, head_dim = q.shape
    cache_shape = k_cache.shape
    kv_heads = cache_shape[2]
    merge_here = counters is not None and splits > 1
    pdl = use_pdl(q.device)
    meta = _decode_meta(heads // kv_heads, head_dim, cache_shape[1], q.dtype, splits, decode_config(head_dim), pdl,
                        merge_here)
    out = q.new_empty(batch, heads, head_dim)
    if splits == 1:
        part_out = part_lse = counters = out  # unused: each program writes its output itself
    else:
        # One fp32 buffer: the partial outputs [batch, heads, splits, head_dim], then their log-sum-exps.
        n_parts = batch * heads * splits
        part_out = q.new_empty(n_parts * (head_dim + 1), dtype=torch.float32)
        part_lse = part_out[n_parts * head_dim:]
        if counters is None:
            counters = out  # not read: the merge kernel below does the merge
    q_stride, kc_stride, vc_stride, out_stride = q.stride(), k_cache.stride(), v_cache.stride(), out.stride()
    table_shape = block_tables.shape
    launch(_decode_kernel, (batch, kv_heads, splits),
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, counters, out,
        q_stride[0], q_stride[1], kc_stride[0], kc_stride[1], kc_stride[2],
        vc_stride[0], vc_stride[1], vc_stride[2], block_tables.stride()[0], out_stride[0], out_stride[1],
        splits, scale * LOG2E, cache_shape[0], table_shape[1] * cache_shape[1], **meta,
    )
    if splits > 1 and not merge_here:
        launch(_decode_merge_kernel, (batch * heads,),
            part_out, part_lse, out, out_stride[0], out_stride[1], heads, splits,
            HEAD_DIM=head_dim, BLOCK_D=meta["BLOCK_D"], SPLITS_PAD=meta["SPLITS_PAD"], USE_PDL=pdl,
            num_warps=4, launch_pdl=pdl,
        )
    return out


# float32 values in one element of each input dtype: the partials are sized in the output's elements.
_ELEMENTS_PER_FLOAT32 = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 2}


def dense_buffer_elements(batch: int, heads: int, head_dim: int, splits: int, dtype: torch.dtype) -> int:
    """Elements (of the output's dtype) of _dense_decode_kernel's one allocation with several splits: the
    output, then the fp32 partial outputs [batch, heads, splits, head_dim] and their log-sum-exps."""
    return batch * heads * head_dim + batch * heads * splits * (head_dim + 1) * _ELEMENTS_PER_FLOAT32[dtype]


def dense_output(q: torch.Tensor, buffer_elements: int) -> torch.Tensor:
    """The output [batch, heads, head_dim] for q, at the start of a buffer of `buffer_elements` (0: its own)."""
    if not buffer_elements:
        return q.new_empty(q.shape)
    _, heads, head_dim = q.shape
    return q.new_empty(buffer_elements).as_strided(q.shape, (heads * head_dim, head_dim, 1))


def dense_decode_launch(q, k_cache, v_cache, block_tables, seq_lens, scale, splits, counters=None) -> torch.Tensor:
    """decode_launch for inputs of the dense layout (_dense_inputs_ok), in one launch: one split, or the
    merge in the splits' launch (counters, as decode_attention's, required then). One allocation: with
    several splits, the output's goes on with the partials."""
    batch, heads, head_dim = q.shape
    cache_shape = k_cache.shape
    merge_here = splits > 1
    launcher = _dense_decode_launcher(heads // cache_shape[2], head_dim, cache_shape[1], q.dtype, splits,
                                      decode_config(head_dim), use_pdl(q.device))
    out = dense_output(q, dense_buffer_elements(batch, heads, head_dim, splits, q.dtype) if merge_here else 0)
    launcher((batch, cache_shape[2], splits),
        q, k_cache, v_cache, block_tables, seq_lens, out, counters if merge_here else None, None, splits,
        scale * LOG2E, cache_shape[0], block_tables.shape[1] * cache_shape[1], 0,
    )
    return out


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


_Tensor = torch.Tensor


def check_int(name: str, value: object, minimum: int) -> None:
    """An int (not a bool) of at least `minimum` (1: positive, 0: non-negative)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be a {'positive' if minimum else 'non-negative'} int, got {value!r}")


def _check_int_tensor(name: str, t: object, ndim: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the cache is on {device}")


def _check_caches(k_cache: object, v_cache: object) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_float_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, kv_heads, head_dim], got shape {tuple(t.shape)}")
        if t.stride(3) != 1:
            raise ValueError(f"{name} must have a unit-stride head_dim, got strides {t.stride()}")
    check_like("v_cache", v_cache, "k_cache", k_cache)
    block_size = k_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"k_cache's block_size (dim 1) must be a power of two, got {block_size}")


def _caches_ok(k_cache: object, v_cache: object) -> bool:
    """`_check_caches` would pass: its checks in one pass."""
    if not (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)):
        return False
    shape = k_cache.shape
    block_size = shape[1] if len(shape) == 4 else 0
    return (k_cache.dtype in FLOAT_DTYPES and on_kernel_device(k_cache) and block_size >= 1
            and not block_size & (block_size - 1) and v_cache.dtype is k_cache.dtype and v_cache.shape == shape
            and v_cache.device == k_cache.device and k_cache.stride()[3] == 1 and v_cache.stride()[3] == 1)


def store_inputs_ok(k: object, v: object, k_cache: object, v_cache: object, slot_mapping: object) -> bool:
    """`check_store_inputs` would pass: its checks in one pass."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and isinstance(slot_mapping, torch.Tensor)
            and _caches_ok(k_cache, v_cache)):
        return False
    k_shape, v_shape, slots_shape, cache_shape = k.shape, v.shape, slot_mapping.shape, k_cache.shape
    device = k_cache.device
    return (k.dtype in FLOAT_DTYPES and v.dtype in FLOAT_DTYPES and len(k_shape) == 3 and len(v_shape) == 3
            and k_shape[1] == v_shape[1] == cache_shape[2] and k_shape[2] == v_shape[2] == cache_shape[3]
            and v_shape[0] == k_shape[0] and k.device == device and v.device == device
            and slot_mapping.dtype is torch.int32 and len(slots_shape) == 1 and slots_shape[0] == k_shape[0]
            and slot_mapping.device == device)


def _decode_inputs_ok(q: object, k_cache: object, v_cache: object, block_tables: object, seq_lens: object) -> bool:
    """decode_attention's checks of its tensors would pass: in one pass."""
    if not (isinstance(q, torch.Tensor) and isinstance(block_tables, torch.Tensor)
            and isinstance(seq_lens, torch.Tensor) and _caches_ok(k_cache, v_cache)):
        return False
    q_shape, cache_shape, table_shape, lens_shape = q.shape, k_cache.shape, block_tables.shape, seq_lens.shape
    device = q.device
    if len(q_shape) != 3:
        return False
    batch, heads, head_dim = q_shape
    kv_heads = cache_shape[2]
    # q's dtype and device are the cache's, so q is a float tensor on the kernels' device too.
    return (q.dtype is k_cache.dtype and device == k_cache.device and head_dim in SUPPORTED_HEAD_DIMS
            and cache_shape[3] == head_dim and kv_heads != 0 and heads % kv_heads == 0
            and block_tables.dtype is torch.int32 and len(table_shape) == 2 and table_shape[0] == batch
            and block_tables.device == device and seq_lens.dtype is torch.int32 and len(lens_shape) == 1
            and lens_shape[0] == batch and seq_lens.device == device)


def _dense_inputs_ok(q: object, k_cache: object, v_cache: object, block_tables: object, seq_lens: object) -> bool:
    """`_decode_inputs_ok`, and every tensor contiguous: the layout of an engine's decode step, which
    _dense_decode_kernel takes. One pass."""
    if not (isinstance(q, _Tensor) and isinstance(k_cache, _Tensor) and isinstance(v_cache, _Tensor)
            and isinstance(block_tables, _Tensor) and isinstance(seq_lens, _Tensor)):
        return False
    q_shape, cache_shape, table_shape, lens_shape = q.shape, k_cache.shape, block_tables.shape, seq_lens.shape
    if len(q_shape) != 3 or len(cache_shape) != 4:
        return False
    batch, heads, head_dim = q_shape
    block_size, kv_heads = cache_shape[1], cache_shape[2]
    dtype, device = q.dtype, q.get_device()
    return (dtype in FLOAT_DTYPES and on_kernel_device(q) and k_cache.dtype is dtype and v_cache.dtype is dtype
            and v_cache.shape == cache_shape and block_size >= 1 and not block_size & (block_size - 1)
            and head_dim in SUPPORTED_HEAD_DIMS and cache_shape[3] == head_dim and kv_heads != 0
            and heads % kv_heads == 0 and block_tables.dtype is torch.int32 and len(table_shape) == 2
            and table_shape[0] == batch and seq_lens.dtype is torch.int32 and len(lens_shape) == 1
            and lens_shape[0] == batch and q.is_contiguous() and k_cache.is_contiguous()
            and v_cache.is_contiguous() and block_tables.is_contiguous() and seq_lens.is_contiguous()
            and on_kernel_device(k_cache) and on_kernel_device(v_cache) and on_kernel_device(block_tables)
            and on_kernel_device(seq_lens)  # the device type, then (for CUDA) which device
            and k_cache.get_device() == device and v_cache.get_device() == device
            and block_tables.get_device() == device and seq_lens.get_device() == device)


def check_store_inputs(k: object, v: object, k_cache: object, v_cache: object, slot_mapping: object) -> None:
    """Caches as `_check_caches` wants them, k, v [tokens, kv_heads, head_dim] to match, and one int32
    slot per token: the checks of every op that writes the cache (store_kv, rope.rope_and_store_kv)."""
    _check_caches(k_cache, v_cache)
    for name, t in (("k", k), ("v", v)):
        check_float_tensor(name, t)
        if t.dim() != 3 or tuple(t.shape[1:]) != tuple(k_cache.shape[2:]):
            raise ValueError(f"{name} must be [tokens, {k_cache.shape[2]}, {k_cache.shape[3]}] to match the cache, "
                             f"got shape {tuple(t.shape)}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but k_cache is on {k_cache.device}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v has {v.shape[0]} tokens but k has {k.shape[0]}")
    _check_int_tensor("slot_mapping", slot_mapping, 1, k_cache.device)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_indices: bool | None = None,
) -> None:
    """Write token t's keys and values, k, v [tokens, kv_heads, head_dim], into cache slot
    slot_mapping[t] = block · block_size + offset of k_cache, v_cache, in place. Slot -1 is skipped,
    and so is any other slot outside the cache (nothing is written out of bounds).

    check_indices=True (default: the FUSELAB_CHECK_INDICES environment variable) checks slot_mapping
    on the host first, a sync, and raises ValueError naming a slot outside the cache or repeated."""
    if not store_inputs_ok(k, v, k_cache, v_cache, slot_mapping):
        check_store_inputs(k, v, k_cache, v_cache, slot_mapping)  # the checks one by one, which name what is wrong
    cache_shape = k_cache.shape
    head_dim = cache_shape[3]
    if k_cache.stride()[2] != head_dim or v_cache.stride()[2] != head_dim:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.stride(2) != head_dim:
                raise ValueError(f"{name} must hold each slot's heads side by side (stride {head_dim} on dim 2), "
                                 f"got strides {t.stride()}")
    if indices.requested(check_indices, k_cache.device):
        indices.check_slot_mapping(slot_mapping, cache_shape[0], cache_shape[1])
    if k.shape[0] == 0:
        return
    # Each token's heads must be one contiguous run (true of a slice of a fused qkv projection).
    k_stride, v_stride = k.stride(), v.stride()
    if k_stride[2] != 1 or k_stride[1] != head_dim:
        k = k.contiguous()
    if v_stride[2] != 1 or v_stride[1] != head_dim:
        v = v.contiguous()
    store_kv_launch(k, v, k_cache, v_cache, slot_mapping.contiguous())


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    max_seq_len: int | None = None,
    max_splits: int = 32,
    *,
    check_indices: bool | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence, q [batch, heads, head_dim], over its first
    seq_lens[i] cached tokens, found through block_tables [batch, max_blocks] (int32 block ids).

    kv_heads (the cache's dim 2) may divide heads (grouped-query attention). The context is split
    into at most max_splits parts; how many comes from batch, kv_heads and max_seq_len (default:
    the block table's capacity), never from seq_lens' values, so the call can be captured in a
    CUDA graph and replayed with other lengths. max_seq_len only tunes the split count: longer
    sequences are still right. A sequence of length 0 gets zeros. Entries of block_tables past a
    sequence's length are never read.

    Bad indices never make the kernel read outside its tensors: a length is clamped to
    [0, the tokens a table row holds], and a block id outside the cache reads as zeros (the result
    is then undefined). check_indices=True (default: the FUSELAB_CHECK_INDICES environment
    variable) checks seq_lens and block_tables on the host first, a sync, and raises ValueError
    naming the bad entry.

    counters: where the context is split, the tickets that tell the last split of a sequence's
    key/value head to merge the splits in the same launch: an int32 buffer on q's device with at least
    batch · kv_heads elements, all zero; the kernel leaves them at zero, so a caller that launches on
    one stream may pass one buffer to every call (and a CUDA graph holds it by address). Two launches
    that may run at once (on two streams) must not share one. With it a call is one launch, cheaper
    for the host; without it (the default) a second launch merges, which the GPU runs sooner (the
    Llama 3 1B shape on an H200, 16 layers: 85 µs of GPU time a step against 135 merged in one).
    """
    dense = _dense_inputs_ok(q, k_cache, v_cache, block_tables, seq_lens)
    if not dense and not _decode_inputs_ok(q, k_cache, v_cache, block_tables, seq_lens):
        _check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)  # one by one, naming what is wrong
    batch, heads, head_dim = q.shape
    cache_shape, device = k_cache.shape, q.device
    kv_heads = cache_shape[2]
    if counters is not None and not counters_ok(counters, batch * kv_heads, device):
        check_counters(counters, batch * kv_heads, device)
    # `type(...) is int` first: the common case in one test (a bool, or another type, takes the full one).
    if type(max_splits) is not int or max_splits < 1:
        check_int("max_splits", max_splits, 1)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * cache_shape[1]
    elif type(max_seq_len) is not int or max_seq_len < 0:
        check_int("max_seq_len", max_seq_len, 0)
    scale = resolve_scale(scale, head_dim)  # a float
    if indices.requested(check_indices, device):
        indices.check_paged_context(block_tables, seq_lens, cache_shape[0], cache_shape[1])
    if batch == 0:
        return torch.empty_like(q)
    splits = num_splits(batch, kv_heads, max_seq_len, max_splits, device)
    if dense and (splits == 1 or counters is not None):
        return dense_decode_launch(q, k_cache, v_cache, block_tables, seq_lens, scale, splits, counters)
    if q.stride()[2] != 1:
        q = q.contiguous()
    return decode_launch(q, k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(), scale, splits,
                         counters)


def _check_decode_inputs(q: object, k_cache: object, v_cache: object, block_tables: object, seq_lens: object) -> None:
    """decode_attention's checks of its tensors, one by one."""
    _check_caches(k_cache, v_cache)
    check_float_tensor("q", q)
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, heads, head_dim], got shape {tuple(q.shape)}")
    if q.device != k_cache.device:
        raise ValueError(f"q is on {q.device} but k_cache is on {k_cache.device}")
    if q.dtype != k_cache.dtype:
        raise TypeError(f"k_cache has dtype {k_cache.dtype} but q has dtype {q.dtype}")
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q has head dim {head_dim}; supported head dims are {SUPPORTED_HEAD_DIMS}")
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache has head dim {k_cache.shape[3]} but q has head dim {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q's {heads} heads must be a whole multiple of k_cache's {kv_heads} kv heads")
    _check_int_tensor("block_tables", block_tables, 2, q.device)
    _check_int_tensor("seq_lens", seq_lens, 1, q.device)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(f"block_tables ({block_tables.shape[0]} rows) and seq_lens ({seq_lens.shape[0]}) "
                         f"must have one entry per sequence of q ({batch})")
