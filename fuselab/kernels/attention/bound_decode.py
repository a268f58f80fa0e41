"""`bind_decode_attention`: decode attention with one layer's cache, scale and tickets checked once.

An engine calls decode attention once a layer a step with the same cache, scale, length limit and
tickets; only the query, the block tables and the lengths change. A bound call checks those three
(one pass), finds the launch of their shapes in a small table (split count, launcher, buffer size:
worked out the first time a shape is seen) and launches, which is about half of `decode_attention`'s
host work at decode size. Inputs it does not take as they are (a strided query, non-contiguous tables,
anything wrong) go through `decode_attention` itself, which handles them or says what is wrong; the
results are decode_attention's, bit for bit.

The bound tensors are not checked again: they must keep their shape, dtype and device while the binding
is used (an engine's caches do). With tickets, calls of one binding must not run at once on two streams,
as decode_attention's `counters` say.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from fuselab.kernels._common import indices
from fuselab.kernels._common.launch import use_pdl
from fuselab.kernels._common.validate import check_counters, counters_ok, on_kernel_device
from fuselab.kernels.attention.common import LOG2E, SUPPORTED_HEAD_DIMS, resolve_scale
from fuselab.kernels.attention.paged_attention import (
    _caches_ok,
    _check_caches,
    _dense_decode_launcher,
    _dense_inputs_ok,
    check_int,
    decode_attention,
    decode_config,
    dense_buffer_elements,
    dense_output,
    num_splits,
)

_Tensor = torch.Tensor
_INT32 = torch.int32


class _Launch(NamedTuple):
    """How a call of one shape launches: worked out once, from shapes only."""

    grid: tuple[int, int, int]
    splits: int
    launcher: Callable[..., None]
    buffer: int  # elements of the output's allocation with the partials after it; 0: the output alone
    merges: bool  # the splits' launch merges (takes the tickets)
    table_capacity: int


class BoundDecodeAttention:
    """`decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, max_splits,
    counters=counters)` as `bound(q, block_tables, seq_lens)`; made by `bind_decode_attention`."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float | None, max_seq_len: int | None,
                 max_splits: int, counters: torch.Tensor | None) -> None:
        if not _caches_ok(k_cache, v_cache):
            _check_caches(k_cache, v_cache)
        head_dim = k_cache.shape[3]
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"k_cache has head dim {head_dim}; supported head dims are {SUPPORTED_HEAD_DIMS}")
        check_int("max_splits", max_splits, minimum=1)
        if max_seq_len is not None:
            check_int("max_seq_len", max_seq_len, minimum=0)
        if counters is not None and not counters_ok(counters, 0, k_cache.device):
            check_counters(counters, 0, k_cache.device)
        self.k_cache, self.v_cache, self.counters = k_cache, v_cache, counters
        self.scale, self.max_seq_len, self.max_splits = resolve_scale(scale, head_dim), max_seq_len, max_splits
        self._scale_log2 = self.scale * LOG2E
        self._device, self._device_index, self._dtype = k_cache.device, k_cache.get_device(), k_cache.dtype
        # By (q's shape, the tables' shape, dependent launch): the launch, or False where those shapes take
        # decode_attention's general path (an empty batch, or several splits and no tickets to merge them).
        self._launches: dict[tuple, _Launch | bool] = {}

    def __call__(self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """decode_attention of q [batch, heads, head_dim] over the bound cache."""
        if isinstance(q, _Tensor) and isinstance(block_tables, _Tensor) and isinstance(seq_lens, _Tensor):
            q_shape, pdl = q.shape, use_pdl(self._device)
            plan = self._launches.get((q_shape, block_tables.shape, pdl))
            device = self._device_index
            # The plan's shapes were checked when it was made: what is left is what a shape does not say.
            if (plan and q.dtype is self._dtype and block_tables.dtype is _INT32
                    and seq_lens.dtype is _INT32 and seq_lens.shape == q_shape[:1] and q.is_contiguous()
                    and block_tables.is_contiguous() and seq_lens.is_contiguous() and on_kernel_device(q)
                    and on_kernel_device(block_tables) and on_kernel_device(seq_lens) and q.get_device() == device
                    and block_tables.get_device() == device and seq_lens.get_device() == device):
                return self._launch(plan, q, block_tables, seq_lens)
            # A first call of these shapes; a query that is not dense goes straight to decode_attention.
            if plan is None and not indices.CHECK_BY_DEFAULT and q.is_contiguous():
                plan = self._plan(q, block_tables, seq_lens, pdl)
                if plan:
                    return self._launch(plan, q, block_tables, seq_lens)
        return decode_attention(q, self.k_cache, self.v_cache, block_tables, seq_lens, self.scale, self.max_seq_len,
                                self.max_splits, counters=self.counters)

    def _launch(self, plan: _Launch, q: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor) -> torch.Tensor:
        out = dense_output(q, plan.buffer)
        plan.launcher(plan.grid, q, self.k_cache, self.v_cache, block_tables, seq_lens, out,
                      self.counters if plan.merges else None, None, plan.splits, self._scale_log2,
                      self.k_cache.shape[0], plan.table_capacity, 0)
        return out

    def _plan(self, q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              pdl: bool) -> _Launch | bool | None:
        """The launch of these inputs' shapes, kept for later calls, where they are the dense layout that
        one launch takes; else False (kept too: the shapes take decode_attention's general path) or None
        (these inputs do, or they are wrong: decode_attention says how)."""
        k_cache = self.k_cache
        if not _dense_inputs_ok(q, k_cache, self.v_cache, block_tables, seq_lens):
            return None
        batch, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        table_capacity = block_tables.shape[1] * block_size
        max_seq_len = table_capacity if self.max_seq_len is None else self.max_seq_len
        splits = num_splits(batch, kv_heads, max_seq_len, self.max_splits, self._device)
        merges = splits > 1
        key = (q.shape, block_tables.shape, pdl)
        if batch == 0 or merges and self.counters is None:
            self._launches[key] = False  # decode_attention: an empty output, or the merge as a second launch
            return False
        if merges and self.counters.numel() < batch * kv_heads:
            check_counters(self.counters, batch * kv_heads, self._device)
        buffer = dense_buffer_elements(batch, heads, head_dim, splits, q.dtype) if merges else 0
        launcher = _dense_decode_launcher(heads // kv_heads, head_dim, block_size, q.dtype, splits,
                                          decode_config(head_dim), pdl)
        plan = _Launch((batch, kv_heads, splits), splits, launcher, buffer, merges, table_capacity)
        self._launches[key] = plan
        return plan


def bind_decode_attention(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float | None = None,
    max_seq_len: int | None = None,
    max_splits: int = 32,
    *,
    counters: torch.Tensor | None = None,
) -> BoundDecodeAttention:
    """`decode_attention` with these arguments fixed and checked now: `bound(q, block_tables, seq_lens)`
    returns what `decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
    max_splits, counters=counters)` would, for about half the host time a call (an engine's decode step
    calls it once a layer). The bound tensors must keep their shape, dtype and device while it is used."""
    return BoundDecodeAttention(k_cache, v_cache, scale, max_seq_len, max_splits, counters)
