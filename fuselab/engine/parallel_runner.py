"""ParallelRunner: the caller's ModelRunner when the model runs tensor-parallel over N ranks.

Every rank (a child process, fuselab.engine.workers) holds its shard of the model and of the KV
cache and a ModelRunner of its own, captured graphs included; the caller keeps the scheduler and
the Sequences. Each step the caller sends every rank the same compact description of the batch
(a prefill's whole sequences; for a decode, per sequence its length, in-flight count, last token
and the blocks added since the rank last heard of it), each rank mirrors the sequences and
launches the same step as a single-process runner would, and all ranks sample the same tokens
(parallel.py says why). A rank answers step t's tokens once it has launched step t+1, so the GPU
runs step t+1 while the caller reads step t's tokens, as in the single-process engine.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fuselab.engine.engine_config import EngineConfig
from fuselab.engine.parallel import init_rank
from fuselab.engine.runner import ModelRunner, StepOutput, build_runner
from fuselab.engine.sampling_params import SamplingParams
from fuselab.engine.sequence import Sequence, SequenceStatus
from fuselab.engine.workers import TensorParallelError, WorkerGroup

# Loading an 8B checkpoint and capturing every decode graph takes minutes at most; a healthy step
# well under a second. Beyond these a rank is taken to be hung. The ranks' collectives time out
# after STARTUP_TIMEOUT_S (while loading, a fast rank waits in one for the slowest).
STARTUP_TIMEOUT_S = 900.0
STEP_TIMEOUT_S = 120.0


class RemoteStep:
    """A launched step, as StepOutput is for the single-process runner: its sequences, and its
    tokens once `token_ids()` has them from the ranks."""

    def __init__(self, runner: "ParallelRunner", step: int, seqs: list[Sequence]) -> None:
        self.seqs = seqs
        self._runner = runner
        self._step = step

    def token_ids(self) -> list[int]:
        return self._runner.tokens_of(self._step)


class ParallelRunner:
    """Starts engine_config.tensor_parallel_size ranks, waits until each has loaded its shard and
    captured its graphs, then runs steps on them (`launch`). A rank's failure, or no answer in
    time, raises workers.TensorParallelError and stops every rank; so does `close`."""

    def __init__(self, engine_config: EngineConfig, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 step_timeout_s: float = STEP_TIMEOUT_S) -> None:
        self.step_timeout_s = step_timeout_s
        self.group = WorkerGroup(run_rank, engine_config.tensor_parallel_size, (engine_config, startup_timeout_s))
        ready = self.group.receive_all(startup_timeout_s, "at startup (loading the model, capturing its graphs)")
        self.num_kv_blocks, self.capture_s = ready[0]
        self._step = 0
        self._read_asked = False  # whether the newest step's tokens were asked for before a later launch
        self._known: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (sequence, blocks the ranks have)

    def launch(self, seqs: list[Sequence], is_prefill: bool) -> RemoteStep:
        """Queue one step on every rank and return at once, as ModelRunner.launch does."""
        forget = [seq_id for seq_id, (seq, _) in self._known.items() if seq.status is SequenceStatus.FINISHED]
        for seq_id in forget:
            del self._known[seq_id]
        records = []
        for s in seqs:
            if is_prefill:
                # A prefill (first, or after preemption) sends the whole sequence and its new blocks.
                records.append((s.seq_id, s.token_ids, s.num_prompt_tokens, s.params, s.seed, s.block_table,
                                s.num_inflight))
            else:
                sent = self._known[s.seq_id][1]
                records.append((s.seq_id, len(s), s.num_inflight, s.token_ids[-1], s.block_table[sent:]))
            self._known[s.seq_id] = (s, len(s.block_table))
        self._step += 1
        self._read_asked = False
        self.group.send(("launch", self._step, is_prefill, records, forget))
        for s in seqs:
            s.num_inflight += 1
        return RemoteStep(self, self._step, seqs)

    def tokens_of(self, step: int) -> list[int]:
        """Step `step`'s sampled tokens (rank 0's; every rank has the same)."""
        if step == self._step and not self._read_asked:
            # No later step was launched, whose launch would have made the ranks send these.
            self.group.send(("read",))
            self._read_asked = True
        while True:
            replies = self.group.receive_all(self.step_timeout_s, f"step {step}")
            got, tokens = replies[0]
            if any(reply != replies[0] for reply in replies[1:]):
                # Ranks that drew different tokens would feed their shards different inputs from now on.
                self.group.close()
                raise TensorParallelError(f"the tensor-parallel ranks sampled different tokens at step {got}: "
                                          f"{[reply[1] for reply in replies]}")
            if got == step:
                return tokens
            # Otherwise the tokens of a step dropped unread (a stream closed early): skipped.

    def close(self) -> None:
        self.group.close()


class MirroredSequence:
    """A rank's copy of what ModelRunner and the sampler read of one of the caller's Sequences."""

    def __init__(self, seq_id: int, token_ids: list[int], num_prompt_tokens: int, params: SamplingParams,
                 seed: int, block_table: list[int], num_inflight: int) -> None:
        self.seq_id, self.token_ids, self.num_prompt_tokens = seq_id, token_ids, num_prompt_tokens
        self.params, self.seed, self.block_table = params, seed, list(block_table)
        self.num_host_tokens, self.num_inflight, self.last_token = len(token_ids), num_inflight, token_ids[-1]

    def __len__(self) -> int:
        return self.num_host_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_host_tokens + self.num_inflight

    def advance(self, num_host_tokens: int, num_inflight: int, last_token: int, new_blocks: list[int]) -> None:
        self.num_host_tokens, self.num_inflight, self.last_token = num_host_tokens, num_inflight, last_token
        self.block_table += new_blocks


def run_rank(rank: int, size: int, commands, reply, rendezvous: str, engine_config: EngineConfig,
             timeout_s: float) -> None:
    """One rank's life (workers.WorkerGroup's target): join the group, build its shard of the
    engine, say it is ready (its KV block count, its graphs' capture time), then run steps."""
    cuda = engine_config.device.type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the host's cores
    tp = init_rank(rank, size, rendezvous, device, timeout_s)
    _, kv_cache, runner = build_runner(engine_config, device, tp)
    reply((kv_cache.num_blocks, None if runner.graphs is None else runner.graphs.capture_s))
    _serve(runner, commands, reply)
    # Only on a clean stop: after a failure the peers may be gone, and NCCL's teardown could wait on them.
    dist.destroy_process_group()


def _serve(runner: ModelRunner, commands, reply) -> None:
    mirrors: dict[int, MirroredSequence] = {}
    pending: tuple[int, StepOutput] | None = None  # the step launched last, its tokens not yet sent
    while (command := commands()) is not None:
        if command[0] == "launch":
            _, step, is_prefill, records, forget = command
            for seq_id in forget:
                mirrors.pop(seq_id, None)
            seqs = []
            for record in records:
                if is_prefill:
                    mirrors[record[0]] = MirroredSequence(*record)
                else:
                    mirrors[record[0]].advance(*record[1:])
                seqs.append(mirrors[record[0]])
            launched = runner.launch(seqs, is_prefill)
        else:  # "read": the caller waits for the newest step
            launched = None
        if pending is not None:
            reply((pending[0], pending[1].token_ids()))
        pending = None if launched is None else (step, launched)
