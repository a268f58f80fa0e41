"""Scheduler: continuous batching over a paged KV cache.

Each step is either a prefill or a decode. Waiting sequences are prefilled first, several at
once within a token budget, so new requests join as soon as there is room; otherwise every
running sequence decodes one token. When the cache runs out of blocks during decode, the newest
running sequence is preempted: its blocks are freed and it goes back to the front of the waiting
queue, to be recomputed from its prompt and the tokens it already has. No request is dropped.

The engine runs one step ahead of the tokens the host has read: step t+1 is scheduled while the
GPU still runs step t, and `postprocess` sees step t's tokens after that. A sequence whose
max_tokens or max_model_len will be reached by its in-flight token is not decoded again; one that
samples a stop token runs one extra step, whose token `postprocess` drops.
"""

from __future__ import annotations

from collections import deque

from fuselab.engine.kv_cache import BlockManager
from fuselab.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...]) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step and whether it is a prefill."""
        batch: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if num_tokens + len(seq) > self.max_num_batched_tokens or not self.block_manager.can_allocate(seq):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
            num_tokens += len(seq)
        if batch:
            return batch, True

        batch, kept = [], []
        while self.running:
            seq = self.running.popleft()
            if self._reaches_length(seq):  # its in-flight token is its last: it finishes when that is read
                kept.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append(seq)
                batch.append(seq)
                kept.append(seq)
        self.running.extend(kept)
        if not kept and self.waiting:
            # With nothing running every block is free, and the engine checked at start that the
            # longest sequence fits: a waiting sequence that still cannot start is a bug.
            raise RuntimeError(f"sequence {self.waiting[0].seq_id} cannot be scheduled on an idle engine")
        return batch, False

    def _reaches_length(self, seq: Sequence) -> bool:
        return seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> list[Sequence]:
        """Append each sequence's new token; finish and free those that are done. Returns them.
        Tokens of sequences that finished before this step's tokens were read are dropped."""
        finished = []
        for seq, token in zip(seqs, token_ids):
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.append_token(token)
            params = seq.params
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
                seq.finish("stop")
            elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
                seq.finish("length")
            else:
                continue
            self.block_manager.free(seq)
            finished.append(seq)
        if finished:
            # A sequence preempted while its last token was in flight finishes from the waiting queue.
            self.running = deque(s for s in self.running if s.status is SequenceStatus.RUNNING)
            self.waiting = deque(s for s in self.waiting if s.status is SequenceStatus.WAITING)
        return finished

    def abort(self, seqs: list[Sequence], reason: str = "abort") -> None:
        """Drop unfinished sequences (a caller stopped reading a stream) and give back their blocks.
        reason is their finish reason: "stop" where the host found a stop string in the text."""
        dropped = {id(s) for s in seqs if s.status is not SequenceStatus.FINISHED}
        for seq in seqs:
            if id(seq) in dropped:
                self.block_manager.free(seq)
                seq.finish(reason)
        self.waiting = deque(s for s in self.waiting if id(s) not in dropped)
        self.running = deque(s for s in self.running if id(s) not in dropped)
