"""LLM: the engine's front door. Load a model, then `generate` (or `generate_stream`) from prompts."""

from __future__ import annotations

import json
import os
import secrets
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence as SequenceType

import torch

from fuselab.device import default_device, has_cuda
from fuselab.engine.config import PRESETS, ModelConfig, eos_token_ids
from fuselab.engine.kv_cache import BlockManager, KVCache, num_blocks_for_memory
from fuselab.engine.model import build_model
from fuselab.engine.runner import ModelRunner, StepOutput
from fuselab.engine.sampler import Sampler
from fuselab.engine.sampling_params import SamplingParams, is_int
from fuselab.engine.scheduler import Scheduler
from fuselab.engine.sequence import RequestOutput, Sequence, SequenceStatus
from fuselab.engine.tokenizer import load_tokenizer
from fuselab.engine.weights import init_random, load_checkpoint
from fuselab.kernels import ATTENTION_HEAD_DIMS

MODES = ("eager", "fused", "graphs")
# Block tables and the decode split count are sized from max_model_len; Llama 3's 128k context
# would make every decode step pay for it. Ask for more explicitly.
DEFAULT_MAX_MODEL_LEN = 4096
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
_warned: set[str] = set()


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
    prompt + output. One generate call runs at a time.
    """

    def __init__(self, model: str | os.PathLike, mode: str = "graphs", dtype: str | torch.dtype | None = None,
                 device: str | torch.device | None = None, max_num_seqs: int = 256, max_model_len: int | None = None,
                 kv_cache_memory_fraction: float = 0.9, *, block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_batched_tokens: int | None = None) -> None:
        model_dir, config = _resolve_model(model)
        self.device = _resolve_device(device)
        self.mode = _resolve_mode(mode, self.device)
        self.dtype = _resolve_dtype(dtype, config, self.device)
        self.config = config
        if self.mode != "eager" and config.head_dim not in ATTENTION_HEAD_DIMS:
            raise ValueError(f"mode {self.mode!r} needs a head dim in {ATTENTION_HEAD_DIMS}; this model's is "
                             f"{config.head_dim} (use mode='eager')")
        _check_positive_int("max_num_seqs", max_num_seqs)
        _check_positive_int("block_size", block_size)
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if max_model_len is None:
            max_model_len = min(DEFAULT_MAX_MODEL_LEN, config.max_position_embeddings)
        _check_positive_int("max_model_len", max_model_len)
        if max_model_len < 2 or max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {config.max_position_embeddings}] for this model, "
                             f"got {max_model_len}")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(max_model_len, 8192)
        _check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if max_num_batched_tokens < max_model_len:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least max_model_len "
                             f"({max_model_len}), so that the longest prompt can be prefilled")
        if not isinstance(kv_cache_memory_fraction, (int, float)) or not 0 < kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {kv_cache_memory_fraction!r}")
        self.max_model_len = max_model_len

        self.model = build_model(config, self.dtype, self.device, max_model_len, self.mode)
        if model_dir is None:
            init_random(self.model)
        else:
            load_checkpoint(self.model, model_dir)
        self.tokenizer = load_tokenizer(model_dir)

        blocks_per_seq = -(-max_model_len // block_size)
        if num_kv_blocks is None:
            num_kv_blocks = num_blocks_for_memory(config, block_size, self.dtype, self.device,
                                                  kv_cache_memory_fraction, max_num_seqs * blocks_per_seq)
        else:
            _check_positive_int("num_kv_blocks", num_kv_blocks)
        if num_kv_blocks < blocks_per_seq:
            raise ValueError(f"the KV cache holds {num_kv_blocks} blocks of {block_size} tokens, fewer than one "
                             f"sequence of max_model_len={max_model_len} needs ({blocks_per_seq}): lower "
                             "max_model_len or give the cache more memory")
        self.kv_cache = KVCache(config, num_kv_blocks, block_size, self.dtype, self.device)
        self.scheduler = Scheduler(BlockManager(num_kv_blocks, block_size), max_num_seqs, max_num_batched_tokens,
                                   max_model_len, config.eos_token_ids + _generation_eos(model_dir))
        self.runner = ModelRunner(self.model, self.kv_cache, Sampler(), self.device, max_num_seqs,
                                  cuda_graphs=self.mode == "graphs")
        self._in_flight: StepOutput | None = None  # the step the GPU may still be running
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
                for seq, token in self._step():
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

    def _step(self) -> list[tuple[Sequence, int]]:
        """Launch the next step, then read the tokens of the one before it: the GPU runs step t
        while the host schedules step t+1, so it never waits for the host. Returns the tokens
        read, less those of sequences that stopped a step earlier."""
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
        token_lists = [self._prompt_token_ids(i, p) for i, p in enumerate(prompts)]
        seqs = []
        for ids, params in zip(token_lists, params_list):
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            seqs.append(Sequence(self._next_seq_id, ids, params, seed))
            self._next_seq_id += 1
        return seqs

    def _prompt_token_ids(self, i: int, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompts[{i}] is a string but the model has no tokenizer.json: pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError(f"prompts[{i}] must be a string or a list of int token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"prompts[{i}] is empty")
        vocab = self.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompts[{i}] holds token id {bad}, outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompts[{i}] has {len(ids)} tokens: max_model_len={self.max_model_len} leaves no room "
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


# -------------------------------------------------------------------------------------------
# Arguments
# -------------------------------------------------------------------------------------------


def _check_positive_int(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)


def _resolve_model(model: object) -> tuple[Path | None, ModelConfig]:
    """(checkpoint directory or None for a preset, its config)."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a checkpoint directory or a preset name, got {type(model).__name__}")
    path = Path(model)
    if path.is_dir():
        return path, ModelConfig.from_dir(path)
    if isinstance(model, str) and model in PRESETS:
        return None, ModelConfig.preset(model)
    raise ValueError(f"model {str(model)!r} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})")


def _resolve_device(device: object) -> torch.device:
    if device is None:
        return default_device()
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device: {e}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {str(device)!r}")
    if device.type == "cuda" and not has_cuda():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is available")
    return device


def _resolve_mode(mode: object, device: torch.device) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if device.type == "cpu" and mode == "graphs":
        _warn_once("mode 'graphs' needs a CUDA GPU: running mode 'eager' on the CPU")
        return "eager"
    if device.type == "cpu" and mode == "fused":
        _warn_once("mode 'fused' on the CPU runs the Triton kernels through the interpreter: slow, tiny models only")
    return mode


def _resolve_dtype(dtype: object, config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype is None:
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if config.dtype == "float16" else torch.bfloat16
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        return dtype
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch dtype among them, got {dtype!r}")


def _generation_eos(model_dir: Path | None) -> tuple[int, ...]:
    """Chat checkpoints list more end tokens (Llama 3's <|eot_id|>) in generation_config.json."""
    path = None if model_dir is None else model_dir / "generation_config.json"
    if path is None or not path.is_file():
        return ()
    return eos_token_ids(json.loads(path.read_text()))


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
