"""The fuselab engine: Llama-family inference from local checkpoints with a paged KV cache and
continuous batching. `LLM(model).generate(prompts, SamplingParams(...))`."""

from fuselab.engine.llm import LLM, StreamToken
from fuselab.engine.sampling_params import SamplingParams
from fuselab.engine.sequence import RequestMetrics, RequestOutput

__all__ = ["LLM", "RequestMetrics", "RequestOutput", "SamplingParams", "StreamToken"]
