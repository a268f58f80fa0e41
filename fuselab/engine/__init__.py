"""The fuselab engine: Llama-family inference from local checkpoints with a paged KV cache and
continuous batching. `LLM(model).generate(prompts, SamplingParams(...))`."""

from fuselab.engine.sampling_params import SamplingParams
from fuselab.engine.sequence import RequestMetrics, RequestOutput

__all__ = ["LLM", "RequestMetrics", "RequestOutput", "SamplingParams", "StreamToken"]


def __getattr__(name: str):
    # LLM loads Triton and the kernels: imported on first use, so that `fuselab --help` stays quick.
    if name in ("LLM", "StreamToken"):
        from fuselab.engine import llm

        globals().update(LLM=llm.LLM, StreamToken=llm.StreamToken)
        return globals()[name]
    raise AttributeError(f"module 'fuselab.engine' has no attribute {name!r}")
