"""ModelRunner: turns a scheduled batch into the model's tensors, runs prefill or decode, samples.

Batch tensors are built on the host and copied to the device without blocking. A decode batch
has fixed-width block tables (enough blocks for max_model_len), so its tensors' shapes depend on
the batch size only: what a captured decode graph per batch bucket needs.
"""

from __future__ import annotations

import torch

from fuselab.engine.kv_cache import KVCache
from fuselab.engine.model import AttentionMetadata, LlamaForCausalLM
from fuselab.engine.sampler import Sampler, SamplingBatch
from fuselab.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, sampler: Sampler, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.block_size
        self.max_blocks_per_seq = -(-model.max_model_len // kv_cache.block_size)
        # Pinned host memory lets the copies to the GPU run asynchronously.
        self._pin = device.type == "cuda"

    def _to_device(self, data: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, pin_memory=self._pin).to(self.device, non_blocking=True)

    def _slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, metadata, index of each sequence's last token) for the whole of each sequence."""
        input_ids, positions, slots, cu_seqlens = [], [], [], [0]
        for seq in seqs:
            n = len(seq)
            input_ids += seq.token_ids
            positions += range(n)
            slots += [self._slot(seq, p) for p in range(n)]
            cu_seqlens.append(cu_seqlens[-1] + n)
        attn = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._to_device(slots),
            cu_seqlens=self._to_device(cu_seqlens),
            max_seqlen=max(len(s) for s in seqs),
        )
        last = self._to_device([end - 1 for end in cu_seqlens[1:]], torch.int64)
        return self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64), attn, last

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) for each sequence's newest token."""
        positions = [len(s) - 1 for s in seqs]
        tables = [s.block_table + [0] * (self.max_blocks_per_seq - len(s.block_table)) for s in seqs]
        attn = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self._to_device([self._slot(s, p) for s, p in zip(seqs, positions)]),
            block_tables=self._to_device(tables),
            seq_lens=self._to_device([len(s) for s in seqs]),
        )
        return self._to_device([s.last_token for s in seqs], torch.int64), self._to_device(positions, torch.int64), attn

    @torch.inference_mode()
    def compute_logits(self, seqs: list[Sequence], is_prefill: bool) -> torch.Tensor:
        """Float32 logits [len(seqs), vocab] of the next token of each sequence; writes their KV."""
        if is_prefill:
            input_ids, positions, attn, last = self.prepare_prefill(seqs)
        else:
            input_ids, positions, attn = self.prepare_decode(seqs)
        hidden = self.model(input_ids, positions, attn, self.kv_cache.k, self.kv_cache.v)
        if is_prefill:
            hidden = hidden[last]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        logits = self.compute_logits(seqs, is_prefill)
        tokens = self.sampler(logits, SamplingBatch.from_sequences(seqs, self.device))
        return tokens.tolist()  # the step's one host sync
