"""The server's Prometheus metrics, kept per server (no process-wide registry) and written in the
Prometheus text format (version 0.0.4) for GET /metrics.

Requests are counted when they end (finished, stopped or aborted), with their prompt and
generated tokens, time to first token, inter-token latencies and end-to-end latency, all as the
engine's host saw them; refused requests are counted by HTTP status. The scheduler's running
and waiting requests, KV-cache use and preemptions are read at each scrape.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

from fuselab.engine.async_llm import EngineStats
from fuselab.engine.sequence import Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "fuselab_"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*map(_number, self.buckets), "+Inf"), self.counts):
            total += count
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        return [*out, f"{name}_sum {_number(self.sum)}", f"{name}_count {total}"]


class ServerMetrics:
    """Filled from the engine thread (`on_finish`) and the HTTP side (`refused`); read by `render`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finished: Counter[str] = Counter()  # by finish reason
        self.refused: Counter[int] = Counter()  # by HTTP status
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)

    def on_finish(self, seq: Sequence) -> None:
        times = seq.token_times
        with self._lock:
            self.finished[seq.finish_reason or "abort"] += 1
            self.prompt_tokens += seq.num_prompt_tokens
            self.generation_tokens += seq.num_output_tokens
            if times:
                self.ttft.observe(times[0] - seq.arrival_time)
                self.latency.observe(times[-1] - seq.arrival_time)
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)

    def on_refused(self, status: int) -> None:
        with self._lock:
            self.refused[status] += 1

    def render(self, stats: EngineStats) -> str:
        used = 1 - stats.num_free_kv_blocks / stats.num_kv_blocks
        with self._lock:
            families = [
                ("requests_total", "counter", "Requests ended, by finish reason (abort: the client left or cancelled).",
                 [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.finished.items())]),
                ("requests_refused_total", "counter", "Requests refused with an error, by HTTP status.",
                 [(f'{{status="{s}"}}', n) for s, n in sorted(self.refused.items())]),
                ("prompt_tokens_total", "counter", "Prompt tokens of ended requests.", [("", self.prompt_tokens)]),
                ("generation_tokens_total", "counter", "Tokens generated for ended requests.",
                 [("", self.generation_tokens)]),
                ("requests_running", "gauge", "Requests in the running batch.", [("", stats.num_running)]),
                ("requests_waiting", "gauge", "Requests waiting for a place in the batch.", [("", stats.num_waiting)]),
                ("kv_cache_usage_ratio", "gauge", "Share of the KV-cache blocks in use.", [("", used)]),
                ("kv_cache_blocks", "gauge", "KV-cache blocks in all.", [("", stats.num_kv_blocks)]),
                ("preemptions_total", "counter", "Running requests preempted for lack of KV-cache blocks.",
                 [("", stats.num_preemptions)]),
            ]
            lines = []
            for name, kind, help_text, samples in families:
                lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
                lines += [f"{PREFIX}{name}{labels} {_number(value)}" for labels, value in samples]
            for name, help_text, histogram in (
                ("time_to_first_token_seconds", "From arrival to the first token on the host.", self.ttft),
                ("inter_token_latency_seconds", "Between consecutive tokens of a request on the host.", self.itl),
                ("request_latency_seconds", "From arrival to the last token on the host.", self.latency),
            ):
                lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} histogram",
                          *histogram.lines(PREFIX + name)]
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)
