"""`rope_decode_attention`: a decode step's RoPE, KV-cache store and attention in one launch.

A decode step's attention layer takes its qkv projection's row for each sequence's newest token, rotates
q and k (RoPE), writes k and v into the paged cache, then attends over the context: `rope_and_store_kv`
then `decode_attention`, two launches. Here the attention kernel does all of it: each program rotates
the queries it attends with, and the split that holds the newest token writes that token's key and value
into the cache and attends to them from registers (the other splits read only older tokens, so nothing
waits on the store). One kernel fewer a layer; under dependent launch that saves the removed kernel's
time on the GPU, and its host launch where the host is the bound.

Inputs other than the fused kernel's (another RoPE layout, a rotary dim short of the head, strided
tensors) take the two ops, which compute the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from fuselab.kernels._common import indices
from fuselab.kernels._common.fast_launch import launch
from fuselab.kernels._common.launch import next_power_of_2, use_pdl
from fuselab.kernels._common.validate import (
    FLOAT_DTYPES,
    check_counters,
    check_float_tensor,
    counters_ok,
    on_kernel_device,
)
from fuselab.kernels.attention.common import LOG2E, SUPPORTED_HEAD_DIMS, padded_head_dim, resolve_scale
from fuselab.kernels.attention.paged_attention import (
    _caches_ok,
    _check_caches,
    _check_decode_inputs,
    _decode_inputs_ok,
    _dense_decode_launcher,
    check_int,
    decode_attention,
    decode_config,
    dense_buffer_elements,
    num_splits,
)
from fuselab.kernels.attention.paged_decode_kernels import _decode_merge_kernel
from fuselab.kernels.rope_checks import LAYOUTS
from fuselab.kernels.rope_store import rope_and_store_kv

_Tensor = torch.Tensor
_INT32 = torch.int32


class _Launch(NamedTuple):
    """How a call of one shape launches: worked out once, from shapes only."""

    grid: tuple[int, int, int]
    heads: int
    launcher: Callable[..., None]
    buffer: int  # elements of the output's allocation with the partials after it; 0: the output alone
    merges: bool  # the launch merges its splits (takes the tickets); else, with several splits, a second launch
    table_capacity: int


def _heads_of(qkv: torch.Tensor, kv_heads: int, head_dim: int) -> int:
    """The query heads of a qkv row [(heads + 2 · kv_heads) · head_dim], or 0 where its width does not fit."""
    width = qkv.shape[1]
    heads = width // head_dim - 2 * kv_heads if width % head_dim == 0 else 0
    return heads if heads > 0 and heads % kv_heads == 0 else 0


def _check_qkv(qkv: object, k_cache: torch.Tensor) -> int:
    """qkv's checks, naming what is wrong; its query heads."""
    check_float_tensor("qkv", qkv)
    _, _, kv_heads, head_dim = k_cache.shape
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be [batch, (heads + 2 * kv_heads) * head_dim], got shape {tuple(qkv.shape)}")
    heads = _heads_of(qkv, kv_heads, head_dim)
    if not heads:
        raise ValueError(f"qkv's width {qkv.shape[1]} is not (heads + 2 * {kv_heads}) * {head_dim} for the cache's "
                         f"{kv_heads} kv heads of dim {head_dim}, with heads a whole multiple of {kv_heads}")
    if qkv.device != k_cache.device:
        raise ValueError(f"qkv is on {qkv.device} but k_cache is on {k_cache.device}")
    if qkv.dtype != k_cache.dtype:
        raise TypeError(f"k_cache has dtype {k_cache.dtype} but qkv has dtype {qkv.dtype}")
    return heads


def _check_cos_sin(cos_sin: object, k_cache: torch.Tensor) -> None:
    check_float_tensor("cos_sin", cos_sin)
    if cos_sin.dim() != 2 or cos_sin.shape[1] % 2 or not 0 < cos_sin.shape[1] <= k_cache.shape[3]:
        raise ValueError(f"cos_sin must be [max_pos, rotary_dim] with an even rotary_dim of at most the head dim "
                         f"{k_cache.shape[3]}, got shape {tuple(cos_sin.shape)}")
    if cos_sin.device != k_cache.device:
        raise ValueError(f"cos_sin is on {cos_sin.device} but k_cache is on {k_cache.device}")


def _composed(qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens, heads, layout, scale, max_seq_len, max_splits,
              counters) -> torch.Tensor:
    """rope_and_store_kv then decode_attention: the same result for inputs the one kernel does not take.
    decode_attention's checks run first, so that wrong tables or lengths write nothing into the cache."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    q, k, v = qkv.view(qkv.shape[0], heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    if not _decode_inputs_ok(q, k_cache, v_cache, block_tables, seq_lens):
        _check_decode_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    last = seq_lens.long() - 1
    position = last.clamp(min=0)
    if block_tables.shape[1] == 0:
        slots = torch.full_like(last, -1, dtype=_INT32)
    else:
        column = (position // block_size).clamp(max=block_tables.shape[1] - 1)
        blocks = block_tables.long().gather(1, column[:, None])[:, 0]
        in_table = (last >= 0) & (position < block_tables.shape[1] * block_size)
        slots = torch.where(in_table, blocks * block_size + position % block_size, -1).to(_INT32)
    q, _ = rope_and_store_kv(q, k, v, position, cos_sin, k_cache, v_cache, slots, layout)
    return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, max_splits,
                            counters=counters)


class BoundRopeDecodeAttention:
    """`rope_decode_attention(qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
    max_splits, layout, counters=counters)` as `bound(qkv, block_tables, seq_lens)`; made by
    `bind_rope_decode_attention` (or by the function, for one call)."""

    def __init__(self, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float | None,
                 max_seq_len: int | None, max_splits: int, layout: str, counters: torch.Tensor | None) -> None:
        if not _caches_ok(k_cache, v_cache):
            _check_caches(k_cache, v_cache)
        head_dim = k_cache.shape[3]
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"k_cache has head dim {head_dim}; supported head dims are {SUPPORTED_HEAD_DIMS}")
        _check_cos_sin(cos_sin, k_cache)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        check_int("max_splits", max_splits, minimum=1)
        if max_seq_len is not None:
            check_int("max_seq_len", max_seq_len, minimum=0)
        if counters is not None and not counters_ok(counters, 0, k_cache.device):
            check_counters(counters, 0, k_cache.device)
        self.cos_sin, self.k_cache, self.v_cache, self.counters = cos_sin, k_cache, v_cache, counters
        self.scale, self.max_seq_len, self.max_splits, self.layout = (resolve_scale(scale, head_dim), max_seq_len,
                                                                     max_splits, layout)
        self._scale_log2 = self.scale * LOG2E
        self._device, self._device_index, self._dtype = k_cache.device, k_cache.get_device(), k_cache.dtype
        # The one kernel takes rotate-half pairs over the whole head, and every bound tensor dense.
        self._fused = (layout == "rotate_half" and cos_sin.shape[1] == head_dim and cos_sin.is_contiguous()
                       and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype in FLOAT_DTYPES
                       and on_kernel_device(k_cache) and cos_sin.get_device() == self._device_index)
        # By (qkv's shape, the tables' shape, dependent launch): the launch of inputs the one kernel takes.
        self._launches: dict[tuple, _Launch] = {}

    def __call__(self, qkv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Attention of each sequence's newest token, whose q, k, v are the rows of qkv: o [batch, heads,
        head_dim]; its key and value are written into the bound cache first."""
        if isinstance(qkv, _Tensor) and isinstance(block_tables, _Tensor) and isinstance(seq_lens, _Tensor):
            pdl = use_pdl(self._device)
            key = (qkv.shape, block_tables.shape, pdl)
            plan = self._launches.get(key)
            if plan is None and self._fused and not indices.CHECK_BY_DEFAULT:
                plan = self._plan(qkv, block_tables, seq_lens, pdl)
                if plan is not None:
                    self._launches[key] = plan
            device = self._device_index
            # The plan's shapes were checked when it was made: what is left is what a shape does not say.
            if (plan and qkv.dtype is self._dtype and block_tables.dtype is _INT32 and seq_lens.dtype is _INT32
                    and seq_lens.shape == qkv.shape[:1] and qkv.is_contiguous() and block_tables.is_contiguous()
                    and seq_lens.is_contiguous() and on_kernel_device(qkv) and on_kernel_device(block_tables)
                    and on_kernel_device(seq_lens) and qkv.get_device() == device
                    and block_tables.get_device() == device and seq_lens.get_device() == device):
                return self._launch(plan, qkv, block_tables, seq_lens)
        heads = _check_qkv(qkv, self.k_cache)
        if indices.requested(None, self._device) and isinstance(block_tables, _Tensor):
            indices.check_paged_context(block_tables, seq_lens, self.k_cache.shape[0], self.k_cache.shape[1])
        return _composed(qkv, self.cos_sin, self.k_cache, self.v_cache, block_tables, seq_lens, heads, self.layout,
                         self.scale, self.max_seq_len, self.max_splits, self.counters)

    def _launch(self, plan: _Launch, qkv: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor) -> torch.Tensor:
        batch, kv_heads, splits = plan.grid
        head_dim = self.k_cache.shape[3]
        shape = (batch, plan.heads, head_dim)
        if plan.buffer:
            buffer = qkv.new_empty(plan.buffer)
            out = buffer.as_strided(shape, (plan.heads * head_dim, head_dim, 1))
        else:
            out = qkv.new_empty(shape)
        plan.launcher(plan.grid, qkv, self.k_cache, self.v_cache, block_tables, seq_lens, out,
                      self.counters if plan.merges else None, self.cos_sin, splits, self._scale_log2,
                      self.k_cache.shape[0], plan.table_capacity, self.cos_sin.shape[0])
        if splits > 1 and not plan.merges:
            # The partials after the output in its allocation (fp32): [batch, heads, splits, head_dim], then lse.
            n_rows = batch * plan.heads
            parts = buffer[n_rows * head_dim:].view(torch.float32)
            pdl = use_pdl(self._device)
            launch(_decode_merge_kernel, (n_rows,),
                   parts, parts[n_rows * splits * head_dim:], out, plan.heads * head_dim, head_dim, plan.heads, splits,
                   HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
                   SPLITS_PAD=max(2, next_power_of_2(splits)), USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
        return out

    def _plan(self, qkv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              pdl: bool) -> _Launch | None:
        """The launch of these inputs' shapes where they are what the one kernel takes, else None."""
        k_cache = self.k_cache
        _, block_size, kv_heads, head_dim = k_cache.shape
        if not (qkv.dim() == 2 and qkv.dtype is self._dtype and qkv.is_contiguous() and on_kernel_device(qkv)
                and qkv.get_device() == self._device_index and block_tables.dtype is _INT32
                and block_tables.dim() == 2 and block_tables.is_contiguous()
                and block_tables.get_device() == self._device_index and seq_lens.dtype is _INT32
                and seq_lens.dim() == 1 and seq_lens.is_contiguous() and seq_lens.get_device() == self._device_index
                and block_tables.shape[0] == qkv.shape[0] and seq_lens.shape[0] == qkv.shape[0]
                and qkv.shape[0] > 0 and not block_size & (block_size - 1)):
            return None
        heads = _heads_of(qkv, kv_heads, head_dim)
        if not heads:
            return None
        batch = qkv.shape[0]
        table_capacity = block_tables.shape[1] * block_size
        max_seq_len = table_capacity if self.max_seq_len is None else self.max_seq_len
        splits = num_splits(batch, kv_heads, max_seq_len, self.max_splits, self._device)
        merges = splits > 1 and self.counters is not None
        if merges and self.counters.numel() < batch * kv_heads:
            check_counters(self.counters, batch * kv_heads, self._device)
        buffer = dense_buffer_elements(batch, heads, head_dim, splits, qkv.dtype) if splits > 1 else 0
        launcher = _dense_decode_launcher(heads // kv_heads, head_dim, block_size, qkv.dtype, splits,
                                          decode_config(head_dim), pdl, merges, head_dim // 2)
        return _Launch((batch, kv_heads, splits), heads, launcher, buffer, merges, table_capacity)


def bind_rope_decode_attention(
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float | None = None,
    max_seq_len: int | None = None,
    max_splits: int = 32,
    layout: str = "rotate_half",
    *,
    counters: torch.Tensor | None = None,
) -> BoundRopeDecodeAttention:
    """`rope_decode_attention` with one layer's table, caches, scale, limits and tickets fixed and checked
    now: `bound(qkv, block_tables, seq_lens)` (an engine's decode step calls it once a layer). The bound
    tensors must keep their shape, dtype and device while it is used."""
    return BoundRopeDecodeAttention(cos_sin, k_cache, v_cache, scale, max_seq_len, max_splits, layout, counters)


def rope_decode_attention(
    qkv: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    max_seq_len: int | None = None,
    max_splits: int = 32,
    layout: str = "rotate_half",
    *,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of each sequence's newest token from its qkv projection row, the cache store and
    RoPE included: o [batch, heads, head_dim].

    qkv [batch, (heads + 2 · kv_heads) · head_dim] holds, per sequence, the new token's q heads, then its
    k heads, then its v heads (a merged projection's output). The token sits at position seq_lens[i] - 1
    (seq_lens counts it): q and k are rotated there with `cos_sin` [max_pos, rotary_dim] in `layout`
    (as `apply_rope`'s), k and v are written into k_cache and v_cache at the slot block_tables gives that
    position, and the query attends over seq_lens[i] tokens, the new one included. The same as
    `rope_and_store_kv(q, k, v, seq_lens - 1, cos_sin, k_cache, v_cache, slots, layout)` then
    `decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, max_splits,
    counters=counters)`, in one launch for rotate-half RoPE over the whole head and dense inputs (the
    two ops otherwise). A sequence of length 0 gets zeros and stores nothing; a slot outside the cache is
    not written. The cache and argument rules are decode_attention's."""
    bound = BoundRopeDecodeAttention(cos_sin, k_cache, v_cache, scale, max_seq_len, max_splits, layout, counters)
    return bound(qkv, block_tables, seq_lens)
