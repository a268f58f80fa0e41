"""ModelRunner: turns a scheduled batch into the model's tensors, runs prefill or decode, samples.

Nothing here waits for the GPU. Batch tensors are built on the host in pinned memory and copied
to the device without blocking. Sampled tokens stay on the device: the next decode step reads its
input ids from them (`last_tokens`), and their copy to the host is queued behind the step
(`StepOutput`), so the host schedules step t+1 while the GPU runs step t, and reads step t's
tokens after.

In `graphs` mode the decode step (the model on one token per sequence, the logits, the greedy
pick) replays a CUDA graph per batch-size bucket (DecodeGraphs) over static input buffers; prefill
runs eagerly in every mode. A decode batch has fixed-width block tables (enough blocks for
max_model_len), so its shapes depend on the batch size only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fuselab.engine.cuda_graphs import DecodeGraphs
from fuselab.engine.engine_config import EngineConfig
from fuselab.engine.kv_cache import KVCache, num_blocks_for_memory
from fuselab.engine.model import AttentionMetadata, LlamaForCausalLM, build_model
from fuselab.engine.parallel import TensorParallel
from fuselab.engine.sampler import Sampler, SamplingBatch
from fuselab.engine.sequence import Sequence
from fuselab.engine.weights import init_random, load_checkpoint
from fuselab.graphs import default_buckets
from fuselab.kernels import dependent_launches


class DecodeInputs(NamedTuple):
    """One decode step's inputs, a row per sequence; padding rows have slot -1 and context 0."""

    input_ids: torch.Tensor  # [B] int32; -1: the token is still on the device, at last_tokens[prev_rows]
    prev_rows: torch.Tensor  # [B] int32
    positions: torch.Tensor  # [B] int32
    slot_mapping: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32, the new token included
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32

    @staticmethod
    def view(buffer: torch.Tensor, rows: int, max_blocks: int) -> "DecodeInputs":
        """Views of one int32 buffer laid out for `rows` rows: the five [rows] fields, then the
        [rows, max_blocks] tables. One layout per batch size, so a step's inputs are one copy."""
        fields = buffer[: _FIELDS * rows].view(_FIELDS, rows)
        tables = buffer[_FIELDS * rows: rows * (_FIELDS + max_blocks)].view(rows, max_blocks)
        return DecodeInputs(*fields.unbind(0), tables)


_FIELDS = len(DecodeInputs._fields) - 1  # the per-row fields, block tables aside


def prefill_warmup_lengths(max_tokens: int) -> list[int]:
    """1, 2, then each power of two from 16 and the length after it, up to max_tokens: lengths
    that meet every specialization a prefill's kernels compile for (see warm_up_prefill)."""
    lengths, p = [1, 2], 16
    while p <= max_tokens:
        lengths += [p, p + 1]
        p *= 2
    return [n for n in lengths if n <= max_tokens]


class StepOutput:
    """A launched step's sampled tokens: on the device now, on the host once `token_ids()` returns."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, pin: bool) -> None:
        self.seqs = seqs
        self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=pin)
        self._host.copy_(tokens, non_blocking=True)
        self._ready = None
        if tokens.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def token_ids(self) -> list[int]:
        # Waits for this step only, never for the one queued behind it; a step the GPU has already
        # finished costs no blocking call at all.
        if self._ready is not None and not self._ready.query():
            self._ready.synchronize()
        return self._host.tolist()


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, sampler: Sampler, device: torch.device,
                 max_num_seqs: int, cuda_graphs: bool = False) -> None:
        self.model = model
        # Bound before any graph is captured: a graph holds the cache (and the kernels' counters) by address.
        model.bind_kv_cache(kv_cache.k, kv_cache.v, max_num_seqs)
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.block_size
        self.max_blocks_per_seq = -(-model.max_model_len // kv_cache.block_size)
        # Pinned host memory lets the copies between host and GPU run asynchronously.
        self._pin = device.type == "cuda"
        # The latest step's sampled tokens, and each of its sequences' row there: the next decode
        # step feeds them without the host having read them.
        self.last_tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self._last_rows: dict[int, int] = {}
        # A decode step's inputs are staged in pinned host memory and reach the device in one copy.
        # Two host buffers take turns, so the host fills one while the other's copy may be pending.
        size = max_num_seqs * (_FIELDS + self.max_blocks_per_seq)
        self._staging = [torch.zeros(size, dtype=torch.int32, pin_memory=self._pin) for _ in range(2)]
        self._staged = [None, None]  # the copy each host buffer last fed, as an event
        self._device_inputs = torch.zeros(size, dtype=torch.int32, device=device)
        self._steps = 0
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            # One logits buffer for every bucket: each graph would otherwise keep its own.
            self._static_logits = torch.zeros(max_num_seqs, model.config.vocab_size,
                                              dtype=model.model.embed_tokens.weight.dtype, device=device)
            # Greedy tokens go straight to last_tokens from inside the graph: no copy after it.
            self.graphs = DecodeGraphs(self._graph_step, default_buckets(max_num_seqs), device)
            with torch.inference_mode():
                self.graphs.capture()

    # ---------------------------------------------------------------------------------------
    # Inputs
    # ---------------------------------------------------------------------------------------

    def _to_device(self, data: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, pin_memory=self._pin).to(self.device, non_blocking=True)

    def _slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, metadata, index of each sequence's last token) for the whole of each sequence."""
        input_ids, positions, slots, cu_seqlens = [], [], [], [0]
        for seq in seqs:
            n = len(seq)
            input_ids += seq.token_ids
            positions += range(n)
            slots += [self._slot(seq, p) for p in range(n)]
            cu_seqlens.append(cu_seqlens[-1] + n)
        attn = AttentionMetadata(
            is_prefill=True,
            positions=self._to_device(positions, torch.int64),
            slot_mapping=self._to_device(slots),
            cu_seqlens=self._to_device(cu_seqlens),
            max_seqlen=max(len(s) for s in seqs),
        )
        last = self._to_device([end - 1 for end in cu_seqlens[1:]], torch.int64)
        return self._to_device(input_ids, torch.int64), attn, last

    def _device_view(self, rows: int) -> DecodeInputs:
        return DecodeInputs.view(self._device_inputs, rows, self.max_blocks_per_seq)

    def _stage_decode(self, seqs: list[Sequence], rows: int) -> DecodeInputs:
        """The device inputs of `rows` rows for each sequence's newest token (perhaps still in
        flight), rows past len(seqs) padded: filled on the host, sent in one asynchronous copy."""
        turn = self._steps % 2
        self._steps += 1
        pending = self._staged[turn]
        if pending is not None and not pending.query():  # long done in a decode loop: its step was read since
            pending.synchronize()
        host = self._staging[turn]
        n, width = len(seqs), rows * (_FIELDS + self.max_blocks_per_seq)
        view = host[:width].numpy()  # numpy writes: far cheaper than a tensor per field
        view[:] = 0
        fields = view[: _FIELDS * rows].reshape(_FIELDS, rows)
        tables = view[_FIELDS * rows:].reshape(rows, self.max_blocks_per_seq)
        for i, s in enumerate(seqs):  # fields in DecodeInputs' order
            position = s.num_tokens - 1
            inflight = s.num_inflight > 0
            fields[0, i] = -1 if inflight else s.last_token
            fields[1, i] = self._last_rows[s.seq_id] if inflight else 0
            fields[2, i] = position
            fields[3, i] = self._slot(s, position)
            fields[4, i] = s.num_tokens
            tables[i, : len(s.block_table)] = s.block_table
        fields[3, n:] = -1  # padding rows: nothing stored, nothing attended
        self._device_inputs[:width].copy_(host[:width], non_blocking=True)
        if self._pin:
            self._staged[turn] = torch.cuda.Event()
            self._staged[turn].record()
        return self._device_view(rows)

    # ---------------------------------------------------------------------------------------
    # Steps
    # ---------------------------------------------------------------------------------------

    def decode_forward(self, inputs: DecodeInputs, logits_out: torch.Tensor | None = None,
                       tokens_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits in the model's dtype, greedy tokens) of one decode step; the step a CUDA graph
        holds. With `tokens_out`, the greedy tokens are written there (and returned)."""
        attn = AttentionMetadata(is_prefill=False, positions=inputs.positions, slot_mapping=inputs.slot_mapping,
                                 block_tables=inputs.block_tables, seq_lens=inputs.seq_lens)
        with dependent_launches():  # no kernel of a decode step writes a weight
            # A row whose token the host has not read yet takes it from the previous step's output.
            h, residual = self.model(inputs.input_ids, attn, (self.last_tokens, inputs.prev_rows))
            logits = self.model.compute_logits(h, residual, logits_out)
            return logits, self.model.greedy(logits, tokens_out)

    def _graph_step(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step DecodeGraphs warms up (on staged padding rows: no KV stored, no context) and
        then captures (which runs nothing) over the device inputs each replay's copy refills."""
        capturing = torch.cuda.is_current_stream_capturing()
        inputs = self._device_view(bucket) if capturing else self._stage_decode([], bucket)
        return self.decode_forward(inputs, self._static_logits[:bucket], self.last_tokens[:bucket])

    def run_model(self, seqs: list[Sequence], is_prefill: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [len(seqs), vocab] in the model's dtype, greedy tokens [len(seqs)]) of the next
        token of each sequence, whose KV it writes; to be called under torch.inference_mode()."""
        if is_prefill:
            input_ids, attn, last = self._prepare_prefill(seqs)
            h, residual = self.model(input_ids, attn)
            logits = self.model.compute_logits(h[last], residual[last])
            return logits, self.model.greedy(logits)
        if self.graphs is None:
            return self.decode_forward(self._stage_decode(seqs, len(seqs)))
        self._stage_decode(seqs, self.graphs.bucket_for(len(seqs)))
        return self.graphs.replay(len(seqs))

    @torch.inference_mode()
    def warm_up_prefill(self, max_tokens: int) -> None:
        """Run a prefill of each length of `prefill_warmup_lengths`, storing nothing (slot -1), and
        the logits of 1, 2, 16 and 17 sequences. Triton compiles a kernel anew for an int argument
        of 1 or one divisible by 16, and launchers pick tiles by powers of two: unwarmed, the first
        request of each kind waits 0.5-1.5 s for compiles while every request behind it queues."""
        max_len, device = self.model.max_model_len, self.device
        for n in prefill_warmup_lengths(max_tokens):
            lens = [max_len] * (n // max_len) + ([n % max_len] if n % max_len else [])
            bounds = [0]
            for length in lens:
                bounds.append(bounds[-1] + length)
            attn = AttentionMetadata(
                is_prefill=True,
                positions=torch.cat([torch.arange(length, device=device) for length in lens]),
                slot_mapping=torch.full((n,), -1, dtype=torch.int32, device=device),
                cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
                max_seqlen=max(lens),
            )
            h, residual = self.model(torch.zeros(n, dtype=torch.int64, device=device), attn)
            last = torch.tensor(bounds[1:], device=device) - 1
            self.model.greedy(self.model.compute_logits(h[last], residual[last]))
        for rows in (1, 2, 16, 17):
            h = torch.zeros(rows, self.model.config.hidden_size, dtype=self.model.model.embed_tokens.weight.dtype,
                            device=device)
            self.model.greedy(self.model.compute_logits(h, h))

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], is_prefill: bool) -> StepOutput:
        """Queue one step on the device and return at once; its tokens reach the host later."""
        logits, greedy = self.run_model(seqs, is_prefill)
        in_place = self.graphs is not None and not is_prefill  # the graph wrote greedy to last_tokens
        if all(s.params.greedy for s in seqs):
            tokens = greedy
        else:
            tokens = self.sampler(logits, SamplingBatch.from_sequences(seqs, self.device))
            in_place = False
        if not in_place:
            self.last_tokens[: len(seqs)].copy_(tokens)
        self._last_rows = {s.seq_id: i for i, s in enumerate(seqs)}
        for s in seqs:
            s.num_inflight += 1
        return StepOutput(seqs, tokens, self._pin)


def build_runner(engine_config: EngineConfig, device: torch.device,
                 tensor_parallel: TensorParallel | None = None) -> tuple[LlamaForCausalLM, KVCache, ModelRunner]:
    """The model with its weights, the KV cache and the runner over them (its graphs captured) on
    `device`; with `tensor_parallel`, this rank's shard of each, every rank holding as many cache
    blocks as the one with the least memory."""
    config = engine_config.model_config
    model = build_model(config, engine_config.dtype, device, engine_config.max_model_len, engine_config.mode,
                        engine_config.quantization, tensor_parallel)
    if engine_config.model_dir is None:
        init_random(model)
    else:
        load_checkpoint(model, engine_config.model_dir)
    if engine_config.mode != "eager" and tensor_parallel is None:
        model.fold_norms()  # a one-row decode step then runs no norm kernel; "eager" stays the plain reference
    num_kv_blocks = engine_config.num_kv_blocks
    if num_kv_blocks is None:
        # Sized now, from the memory the weights left free.
        num_kv_blocks = num_blocks_for_memory(model.config, engine_config.block_size, engine_config.dtype, device,
                                              engine_config.kv_cache_memory_fraction,
                                              engine_config.max_num_seqs * engine_config.blocks_per_seq)
        if tensor_parallel is not None:
            num_kv_blocks = tensor_parallel.min_over_ranks(num_kv_blocks, device)
        engine_config.check_num_kv_blocks(num_kv_blocks)
    kv_cache = KVCache(model.config, num_kv_blocks, engine_config.block_size, engine_config.dtype, device)
    runner = ModelRunner(model, kv_cache, Sampler(), device, engine_config.max_num_seqs,
                         cuda_graphs=engine_config.mode == "graphs")
    if engine_config.mode != "eager" and device.type == "cuda":
        runner.warm_up_prefill(engine_config.max_num_batched_tokens)
    return model, kv_cache, runner
