"""DecodeGraphs: the decode step captured as one CUDA graph per batch-size bucket, then replayed.

A decode step launches hundreds of kernels (per layer: norms, GEMMs, RoPE, the KV store,
attention) whose GPU work at small batches takes less time than launching them. Replayed from a
graph they cost one launch. A graph replays fixed addresses and shapes, so:

- the step reads its inputs from static buffers sized for the largest bucket (the runner owns
  them); a batch of b rows replays the graph of the smallest bucket >= b, rows b..bucket padded
  so that they change nothing (slot -1: their keys and values are not stored; context length 0:
  attention reads nothing) and their outputs ignored;
- buckets are captured largest first into one shared memory pool, so a smaller bucket reuses the
  memory a larger one freed (the graphs replay one at a time, on one stream);
- the KV cache and the weights are bound by address: they are updated in place, never rebound.

Prefill (a different token count every step) runs eagerly.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from fuselab.device import recover_from_failed_capture
from fuselab.graphs import GraphCaptureError, bucket_for, explain_capture_error

# Eager runs per bucket before capture: the first compiles the Triton kernels and creates the
# cuBLAS workspace of the capture stream; the second lets the caching allocator settle.
_WARMUP_CALLS = 2

DecodeStep = Callable[[int], tuple[torch.Tensor, ...]]


class DecodeGraphs:
    """`step(bucket)` runs the decode step on the first `bucket` rows of the static input buffers
    and returns its outputs (each with the batch as dim 0); `capture()` records it per bucket and
    `replay(batch)` runs the bucket that holds `batch` rows, returning the first `batch` rows."""

    def __init__(self, step: DecodeStep, buckets: tuple[int, ...], device: torch.device) -> None:
        self.step = step
        self.buckets = buckets
        self.device = device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.capture_s = 0.0
        self.replays = 0  # how many decode steps ran from a graph

    def bucket_for(self, batch: int) -> int:
        bucket = bucket_for(batch, self.buckets)
        if bucket is None:
            raise ValueError(f"a decode batch of {batch} is above the largest captured bucket, {self.buckets[-1]}")
        return bucket

    def capture(self) -> None:
        # The graphs keep the GEMM kernels chosen at capture: cuBLASLt's, which beat cuBLAS's
        # (split-K plus a reduce kernel) at 64 rows, by 3% a step at the 8B shape, and match them at one.
        # The setting is process-wide, so it is put back for whatever runs outside the graphs.
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            self._capture()
        finally:
            torch.backends.cuda.preferred_blas_library(previous)

    def _capture(self) -> None:
        start = time.perf_counter()
        caller = torch.cuda.current_stream(self.device)
        # Capture cannot run on the legacy default stream; warming up on the same side stream
        # creates its per-stream state (the cuBLAS workspace) before capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            for bucket in reversed(self.buckets):
                for _ in range(_WARMUP_CALLS):
                    self.step(bucket)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):  # largest first: smaller ones reuse its freed blocks
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    outputs = self.step(bucket)
            except Exception as err:
                recover_from_failed_capture(caller)
                raise GraphCaptureError(explain_capture_error(err, "the decode step", bucket)) from err
            self.graphs[bucket] = (graph, outputs)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start

    def replay(self, batch: int) -> tuple[torch.Tensor, ...]:
        """The step's outputs for the first `batch` rows; views the next replay overwrites."""
        graph, outputs = self.graphs[self.bucket_for(batch)]
        graph.replay()
        self.replays += 1
        return tuple(t[:batch] for t in outputs)
