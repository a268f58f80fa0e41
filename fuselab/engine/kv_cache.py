"""The paged KV cache: per-layer key and value tensors cut into fixed-size blocks, and the
BlockManager that hands blocks to sequences.

A sequence's token t lives in block block_table[t // block_size] at offset t % block_size; its
blocks need not be adjacent, so memory is given out a block at a time as sequences grow and
comes back whole when they finish or are preempted.
"""

from __future__ import annotations

from collections import deque

import torch

from fuselab.engine.config import ModelConfig
from fuselab.engine.sequence import Sequence

# Without a GPU there is no free memory to measure: the cache gets this much host memory at most.
CPU_KV_CACHE_BYTES = 256 << 20


class KVCache:
    """k[layer] and v[layer], each [num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # Zeroed rather than empty: slots past a sequence's end are masked, but masked garbage
        # could still be NaN, and NaN · 0 is NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * config.num_layers * block_size * config.kv_size * dtype.itemsize


def num_blocks_for_memory(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                          memory_fraction: float, max_useful_blocks: int) -> int:
    """How many blocks fit in `memory_fraction` of the GPU memory free now (after the weights are
    loaded), or in CPU_KV_CACHE_BYTES on the CPU; never more than can ever be in use at once."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * memory_fraction)
    else:
        budget = CPU_KV_CACHE_BYTES
    return min(budget // KVCache.bytes_per_block(config, block_size, dtype), max_useful_blocks)


class BlockManager:
    """Free-list allocator of cache blocks; each Sequence holds its own block table."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Room for the KV of all of seq's tokens (a prefill computes them all)."""
        return self.blocks_needed(len(seq)) <= len(self.free_blocks)

    def allocate(self, seq: Sequence) -> None:
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        need = self.blocks_needed(len(seq))
        if need > len(self.free_blocks):
            raise RuntimeError(f"sequence {seq.seq_id} needs {need} blocks, {len(self.free_blocks)} are free")
        seq.block_table = [self.free_blocks.popleft() for _ in range(need)]

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of seq's newest token (perhaps still in flight), the one the next decode step feeds."""
        return self.blocks_needed(seq.num_tokens) - len(seq.block_table) <= len(self.free_blocks)

    def append(self, seq: Sequence) -> None:
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens):
            if not self.free_blocks:
                raise RuntimeError(f"no free block for sequence {seq.seq_id}")
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []
