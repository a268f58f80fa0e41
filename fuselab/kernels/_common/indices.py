"""The validating mode: host-side checks of the index tensors the kernels take (cu_seqlens, seq_lens
and block tables, slot mappings, positions, targets), each raising a ValueError that names the
argument, the offending entry and its value.

Whatever an index tensor holds, the kernels never read or write outside their tensors: they mask
or clamp what an index could make them reach. That keeps memory safe, not the result right, and it
says nothing. These checks say what is wrong. They copy the indices to the host, a sync that a
decode step cannot afford, so they are off unless asked for: `check_indices=True` on a call, or
FUSELAB_CHECK_INDICES=1 in the environment (read once, at import) for every call that does not say.
"""

from __future__ import annotations

import os

import torch

from fuselab.kernels._common.validate import check_flag

CHECK_BY_DEFAULT = os.environ.get("FUSELAB_CHECK_INDICES", "0") == "1"


def requested(check_indices: object, device: torch.device) -> bool:
    """Whether this call checks its index tensors: `check_indices` (a bool), or None for the
    environment's FUSELAB_CHECK_INDICES. While a CUDA graph is captured the environment's checks
    are skipped (nothing can be copied to the host then, and replays bring other indices anyway);
    an explicit check_indices=True raises."""
    explicit = check_indices is not None
    if explicit:
        check_flag("check_indices", check_indices)
    else:
        check_indices = CHECK_BY_DEFAULT
    if check_indices and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        if explicit:
            raise ValueError("check_indices=True cannot copy the indices to the host while a CUDA graph is captured")
        return False
    return check_indices


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.int64)


def _first(bad: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first true entry of `bad`, or None."""
    hits = bad.nonzero()
    return None if hits.shape[0] == 0 else tuple(hits[0].tolist())


def _entry(name: str, index: tuple[int, ...], values: torch.Tensor) -> str:
    return f"{name}[{', '.join(map(str, index))}] = {values[index].item()}"


def check_cu_seqlens(cu_seqlens: torch.Tensor, n_tokens: int, max_seqlen: int) -> None:
    """cu_seqlens starts at 0, never decreases, ends within the n_tokens rows of q, and no sequence
    is longer than max_seqlen."""
    cu = _host(cu_seqlens)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0 (the first sequence starts at row 0), got {cu[0].item()}")
    lengths = cu[1:] - cu[:-1]
    if (i := _first(lengths < 0)) is not None:
        raise ValueError(f"cu_seqlens must be non-decreasing: {_entry('cu_seqlens', (i[0] + 1,), cu)} "
                         f"is below {_entry('cu_seqlens', i, cu)}")
    if (i := _first(cu > n_tokens)) is not None:
        raise ValueError(f"{_entry('cu_seqlens', i, cu)} is past the {n_tokens} tokens of q")
    if (i := _first(lengths > max_seqlen)) is not None:
        raise ValueError(f"max_seqlen = {max_seqlen} is shorter than sequence {i[0]}, of {lengths[i].item()} tokens "
                         f"(cu_seqlens[{i[0] + 1}] - cu_seqlens[{i[0]}])")


def check_paged_context(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every length fits its row of block_tables, and every entry a sequence reads (the first
    ceil(seq_lens[i] / block_size) of row i) is a block of the cache; entries past those are never
    read and may hold anything (-1 padding, say)."""
    lengths, tables = _host(seq_lens), _host(block_tables)
    capacity = tables.shape[1] * block_size
    if (i := _first(lengths < 0)) is not None:
        raise ValueError(f"{_entry('seq_lens', i, lengths)} is negative")
    if (i := _first(lengths > capacity)) is not None:
        raise ValueError(f"{_entry('seq_lens', i, lengths)} is more tokens than a row of block_tables holds "
                         f"({tables.shape[1]} blocks of {block_size})")
    read = torch.arange(tables.shape[1])[None, :] < ((lengths + block_size - 1) // block_size)[:, None]
    if (i := _first(read & ((tables < 0) | (tables >= num_blocks)))) is not None:
        raise ValueError(f"{_entry('block_tables', i, tables)} is not a block of the cache (k_cache has "
                         f"{num_blocks}), and sequence {i[0]} reads it")


def check_slot_mapping(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every slot is in the cache or -1 (no store), and no two tokens write one slot."""
    slots = _host(slot_mapping)
    num_slots = num_blocks * block_size
    if (i := _first((slots < -1) | (slots >= num_slots))) is not None:
        raise ValueError(f"{_entry('slot_mapping', i, slots)} is neither a slot of the cache ({num_slots}: "
                         f"{num_blocks} blocks of {block_size}) nor -1 (no store)")
    # Sorted stably, a repeated slot sits next to its first use, after it.
    order = torch.argsort(slots, stable=True)
    ordered = slots[order]
    if (i := _first((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0))) is not None:
        first, again = order[i[0]].item(), order[i[0] + 1].item()
        raise ValueError(f"{_entry('slot_mapping', (again,), slots)} repeats slot_mapping[{first}]: "
                         f"two tokens would write one slot")


def check_positions(positions: torch.Tensor, max_pos: int) -> None:
    """Every position is a row of the cos_sin cache."""
    values = _host(positions)
    if (i := _first((values < 0) | (values >= max_pos))) is not None:
        raise ValueError(f"{_entry('positions', i, values)} is outside the {max_pos} rows of cos_sin")


def check_targets(target: torch.Tensor, n_vocab: int, ignore_index: int) -> None:
    """Every target is a class of the vocabulary or ignore_index."""
    values = _host(target)
    if (i := _first((values != ignore_index) & ((values < 0) | (values >= n_vocab)))) is not None:
        raise ValueError(f"{_entry('target', i, values)} is neither a class in [0, {n_vocab}) "
                         f"nor ignore_index ({ignore_index})")
