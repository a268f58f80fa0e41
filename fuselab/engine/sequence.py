"""Sequence: one request's tokens and state inside the engine; RequestOutput: what the caller gets back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from fuselab.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not in the cache: new, or preempted and to be recomputed
    RUNNING = "running"  # its KV is in the cache; decoded every step
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestMetrics:
    ttft_s: float  # arrival to first token on the host
    inter_token_latencies_s: list[float]  # between consecutive tokens on the host
    latency_s: float  # arrival to last token


@dataclass(frozen=True)
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only, the stop token included
    text: str | None  # decoded token_ids, when the model has a tokenizer
    finish_reason: str  # "stop" (end-of-sequence or stop token) or "length" (max_tokens or max_model_len)
    metrics: RequestMetrics


class Sequence:
    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int) -> None:
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed  # params.seed, or one drawn at arrival: every request samples from a seeded stream
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # Tokens sampled on the device whose values the host has not read yet: the host schedules
        # a step ahead of the tokens it knows (0 or 1 between steps).
        self.num_inflight = 0
        self.finish_reason: str | None = None
        self.arrival_time = time.perf_counter()
        self.token_times: list[float] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the KV cache and the next step see: those on the host and those still in flight."""
        return len(self.token_ids) + self.num_inflight

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def append_token(self, token_id: int) -> None:
        """The host has read a token: it joins the sequence (an in-flight one stops being in flight)."""
        self.num_inflight = max(0, self.num_inflight - 1)
        self.token_ids.append(token_id)
        self.token_times.append(time.perf_counter())

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason

    def metrics(self) -> RequestMetrics:
        times = self.token_times
        return RequestMetrics(
            ttft_s=times[0] - self.arrival_time,
            inter_token_latencies_s=[b - a for a, b in zip(times, times[1:])],
            latency_s=times[-1] - self.arrival_time,
        )
