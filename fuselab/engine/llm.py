"""LLM: the engine's front door. Load a model, then `generate` (or `generate_stream`) from prompts."""

from __future__ import annotations

import os
import secrets
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence as SequenceType

import torch

from fuselab.engine.config import CheckpointError, eos_token_ids, read_json_object
from fuselab.engine.engine_config import EngineConfig
from fuselab.engine.kv_cache import BlockManager
from fuselab.engine.parallel_runner import ParallelRunner, RemoteStep
from fuselab.engine.runner import StepOutput, build_runner
from fuselab.engine.sampling_params import SamplingParams, is_int
from fuselab.engine.scheduler import Scheduler
from fuselab.engine.sequence import RequestOutput, Sequence, SequenceStatus
from fuselab.engine.tokenizer import load_tokenizer


@dataclass(frozen=True)
class StreamToken:
    index: int  # which prompt of the call
    token_id: int
    text: str | None  # the text this token adds, when the model has a tokenizer
    finish_reason: str | None  # set on the request's last token


class LLM:
    """An inference engine for one Llama-family model (Llama 2/3, Mistral, Qwen2, Qwen3).

    model: a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json if
    any) or a preset with random weights: "tiny", "llama3-1b", "llama3-8b", "qwen3-0.6b".
    mode: "eager" (torch ops), "fused" (fuselab's Triton kernels) or "graphs" (fused, with each
    decode step replayed from a CUDA graph captured per batch-size bucket up to max_num_seqs, at
    construction). Without a GPU, "graphs" runs "eager", and "fused" runs through Triton's
    interpreter (slow: tiny models only).
    dtype: default bfloat16 on a GPU (float16 if the checkpoint is), float32 on the CPU.
    The KV cache takes kv_cache_memory_fraction of the GPU memory left free by the weights
    (num_kv_blocks overrides it); max_model_len (default min(4096, the model's)) bounds
    prompt + output. quantization: "int4" (= "int4-g128"), "int4-g64", "int4-g32", "int8" or
    "fp8" quantizes every linear layer's weight as it loads (fuselab.engine.quantize); a GPTQ
    checkpoint is read as the 4-bit model it is. EngineConfig checks these arguments and resolves
    their defaults (`engine_config`). One generate call runs at a time.

    tensor_parallel_size=N splits the model over N ranks (fuselab.engine.parallel), each a child
    process on its own GPU (cuda:0..N-1; gloo ranks on the CPU), which this engine starts and
    drives; `model` and `kv_cache` then live in the ranks (None here) and `runner` is a
    ParallelRunner. A rank that fails or hangs fails the call with a
    fuselab.engine.workers.TensorParallelError naming it, and stops every rank; `close()` (or
    leaving a `with LLM(...)` block, or the engine's garbage collection, or exit) stops them too.
    Unquantized weights only for now: tensor_parallel_size > 1 with quantization is a ValueError.
    """

    def __init__(self, model: str | os.PathLike, mode: str = "graphs", dtype: str | torch.dtype | None = None,
                 device: str | torch.device | None = None, max_num_seqs: int = 256, max_model_len: int | None = None,
                 kv_cache_memory_fraction: float = 0.9, *, block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_batched_tokens: int | None = None, quantization: str | None = None,
                 tensor_parallel_size: int = 1) -> None:
        self.engine_config = engine_config = EngineConfig(
            model, mode, dtype, device, max_num_seqs, max_model_len, kv_cache_memory_fraction,
            block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=max_num_batched_tokens,
            quantization=quantization, tensor_parallel_size=tensor_parallel_size)
        self.config = config = engine_config.model_config
        self.device, self.mode, self.dtype = engine_config.device, engine_config.mode, engine_config.dtype
        self.max_model_len = engine_config.max_model_len

        # The small files first: a broken one is reported before the weights are read.
        self.tokenizer = load_tokenizer(engine_config.model_dir)
        eos_ids = config.eos_token_ids + _generation_eos(engine_config.model_dir)
        if engine_config.tensor_parallel_size == 1:
            self.model, self.kv_cache, self.runner = build_runner(engine_config, self.device)
            num_kv_blocks = self.kv_cache.num_blocks
        else:
            self.model = self.kv_cache = None
            self.runner = ParallelRunner(engine_config)
            num_kv_blocks = self.runner.num_kv_blocks
        self.num_kv_blocks = num_kv_blocks
        self.scheduler = Scheduler(BlockManager(num_kv_blocks, engine_config.block_size), engine_config.max_num_seqs,
                                   engine_config.max_num_batched_tokens, self.max_model_len, eos_ids)
        self._in_flight: StepOutput | RemoteStep | None = None  # the step the GPU may still be running
        self._next_seq_id = 0

    # ---------------------------------------------------------------------------------------
    # Public API
    # ---------------------------------------------------------------------------------------

    def generate(self, prompts: str | list[int] | SequenceType[str | list[int]],
                 sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
                 *, progress: bool | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts are strings (tokenized with the model's
        tokenizer) or lists of token ids; sampling_params is one for all or one per prompt.
        progress shows a progress bar (default: for several prompts on a terminal)."""
        seqs = self._make_sequences(prompts, sampling_params)
        if progress is None:
            progress = len(seqs) > 1 and sys.stderr.isatty()
        with _progress_bar(progress, len(seqs)) as advance:
            for event in self._run(seqs, with_text=False):
                if event.finish_reason is not None:
                    advance()
        return [self._output(seq) for seq in seqs]

    def generate_stream(self, prompts: str | list[int] | SequenceType[str | list[int]],
                        sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
                        ) -> Iterator[StreamToken]:
        """Yields each token as soon as the host has it. Bad prompts or parameters raise here,
        before the first token; closing the iterator early drops the unfinished requests."""
        return self._run(self._make_sequences(prompts, sampling_params), with_text=self.tokenizer is not None)

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (the engine cannot run after). Idempotent."""
        if isinstance(self.runner, ParallelRunner):
            self.runner.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------
    # Engine loop
    # ---------------------------------------------------------------------------------------

    def _run(self, seqs: list[Sequence], with_text: bool) -> Iterator[StreamToken]:
        first_id = seqs[0].seq_id
        texts = {seq.seq_id: "" for seq in seqs}
        for seq in seqs:
            self.scheduler.add(seq)
        try:
            while self.scheduler.has_unfinished():
                for seq, token in self.step():
                    delta = None
                    if with_text:
                        # Decoding the whole output each time keeps multi-byte characters whole.
                        text = self.tokenizer.decode(seq.output_token_ids)
                        delta, texts[seq.seq_id] = text[len(texts[seq.seq_id]):], text
                    yield StreamToken(seq.seq_id - first_id, token, delta, seq.finish_reason)
        finally:
            self.scheduler.abort(seqs)
            # Its tokens belong to finished or dropped requests; its KV writes land in freed blocks
            # before any later step's, in stream order.
            self._in_flight = None

    def step(self) -> list[tuple[Sequence, int]]:
        """Launch the next step, then read the tokens of the one before it: the GPU runs step t
        while the host schedules step t+1, so it never waits for the host. Returns the tokens
        read, less those of sequences that stopped a step earlier. `generate` runs it until its
        requests are done; a request loop of its own (fuselab.engine.async_llm) adds sequences
        from `make_sequence` to the scheduler and calls it while any is unfinished."""
        batch, is_prefill = self.scheduler.schedule()
        launched = self.runner.launch(batch, is_prefill) if batch else None
        done, self._in_flight = self._in_flight, launched
        if done is None:
            return []
        tokens = done.token_ids()
        kept = [(seq, token) for seq, token in zip(done.seqs, tokens) if seq.status is not SequenceStatus.FINISHED]
        self.scheduler.postprocess(done.seqs, tokens)
        return kept

    def _make_sequences(self, prompts, sampling_params) -> list[Sequence]:
        """Validate every prompt and parameter before any work, then wrap them as Sequences."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_int(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; "
                            f"got {type(prompts).__name__}")
        if not prompts:
            raise ValueError("prompts is empty")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params_list) != len(prompts):
            raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts")
        for i, params in enumerate(params_list):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(params).__name__}")
            self._check_stop_token_ids(params, f"sampling_params[{i}]")
        token_lists = [self._prompt_token_ids(f"prompts[{i}]", p) for i, p in enumerate(prompts)]
        return [self._new_sequence(ids, params) for ids, params in zip(token_lists, params_list)]

    def make_sequence(self, prompt: str | list[int], params: SamplingParams, name: str = "prompt") -> Sequence:
        """One request checked as `generate` checks its prompts, the errors naming it `name`, as a
        Sequence for the scheduler. Not thread-safe: call it from one thread at a time."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        self._check_stop_token_ids(params, "sampling params")
        return self._new_sequence(self._prompt_token_ids(name, prompt), params)

    def _check_stop_token_ids(self, params: SamplingParams, name: str) -> None:
        # SamplingParams is built without a model: only here is the vocabulary known.
        vocab = self.config.vocab_size
        bad = next((j for j, t in enumerate(params.stop_token_ids) if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"{name}.stop_token_ids[{bad}]={params.stop_token_ids[bad]} is outside "
                             f"the vocabulary [0, {vocab})")

    def _new_sequence(self, ids: list[int], params: SamplingParams) -> Sequence:
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._next_seq_id += 1
        return Sequence(self._next_seq_id - 1, ids, params, seed)

    def _prompt_token_ids(self, name: str, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{name} is a string but the model has no tokenizer.json: pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError(f"{name} must be a string or a list of int token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"{name} is empty")
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{name} has {len(ids)} tokens: max_model_len={self.max_model_len} leaves no room "
                             "for output")
        return ids

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=None if self.tokenizer is None else self.tokenizer.decode(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            metrics=seq.metrics(),
        )


def _generation_eos(model_dir: Path | None) -> tuple[int, ...]:
    """Chat checkpoints list more end tokens (Llama 3's <|eot_id|>) in generation_config.json."""
    path = None if model_dir is None else model_dir / "generation_config.json"
    if path is None or not path.is_file():
        return ()
    fields = read_json_object(path)
    try:
        return eos_token_ids(fields)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


@contextmanager
def _progress_bar(enabled: bool, total: int) -> Iterator[Callable[[], None]]:
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # On stderr, so that a script's stdout holds its own output only.
    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("generate", total=total)
        yield lambda: bar.advance(task)
