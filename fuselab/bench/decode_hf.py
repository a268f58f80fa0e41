"""The transformers side of `fuselab bench decode`: the model, a timed plain `generate`, a streamed
one for the latencies, a patched copy for hf-patch, and one decode step for the doctor.

A timed generate is the call a user makes, `model.generate(ids, attention_mask=mask,
max_new_tokens=n, do_sample=False)`: no streamer (which would copy every token to the host and stamp
it), no min_new_tokens; the model has no end-of-sequence token, so every sequence runs n tokens.
Time to first token and inter-token latency come from a separate, streamed generate.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import torch

from fuselab.bench.graphs import count_launches

DTYPE = torch.bfloat16
# Eager generate's kernels are counted over a short call: hundreds of kernels a step make long
# traces slow to record, and every decode step launches the same ones.
EAGER_PROFILED_TOKENS = 17


def build_hf(preset: str):
    """A transformers Llama of the preset's shape, random bf16 weights, on the GPU."""
    import transformers

    from fuselab.engine.config import PRESETS as SHAPES

    fields = {k: v for k, v in SHAPES[preset].items() if k != "model_type"}
    # transformers 5 takes the rope settings as one dict, theta included; no end-of-sequence
    # token, so that every sequence generates all its tokens.
    fields["rope_parameters"] = {**fields.pop("rope_scaling"), "rope_theta": fields.pop("rope_theta")}
    config = transformers.LlamaConfig(**{**fields, "eos_token_id": None})
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)  # initialized in bf16 directly: no float32 copy of an 8B model
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def use_compile_path(model) -> None:
    """transformers' own fast path: with a static cache, generate compiles the decoding forward
    itself (its CompileConfig, reduce-overhead). Compiling model.forward on top of that nests two
    CUDA-graph trees, whose outputs overwrite each other."""
    from transformers import CompileConfig

    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = CompileConfig(mode="reduce-overhead")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate(model, ids: torch.Tensor, new_tokens: int, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              **kwargs)


def generate_s(model, ids: torch.Tensor, new_tokens: int) -> float:
    """Wall seconds of one plain greedy generate of `new_tokens` tokens a sequence, the device idle
    before and after."""
    _sync(ids.device)
    start = time.perf_counter()
    _generate(model, ids, new_tokens)
    _sync(ids.device)
    return time.perf_counter() - start


class TokenClock:
    """A transformers streamer that notes when each new token reaches the host."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True  # the first call hands over the prompt

    def end(self) -> None:
        pass


def streamed_latencies(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, list[float]]:
    """(seconds to the first token, seconds between each next two) of one streamed generate."""
    clock = TokenClock()
    _sync(ids.device)
    start = time.perf_counter()
    _generate(model, ids, new_tokens, streamer=clock)
    _sync(ids.device)
    return clock.times[0] - start, [b - a for a, b in zip(clock.times, clock.times[1:])]


def kernels_per_step(model, ids: torch.Tensor, new_tokens: int, compiled: bool) -> float:
    """A whole generate's kernels over its tokens (its prefill is one token's share). The compiled
    path keeps its length: another would size the static cache anew and compile again."""
    n = new_tokens if compiled else min(new_tokens, EAGER_PROFILED_TOKENS)
    return count_launches(lambda: _generate(model, ids, n))["kernels"] / n


@torch.no_grad()
def patched_copy(model, ids: torch.Tensor) -> tuple[object, dict]:
    """A deep copy of `model` after fuselab.patch (the model itself untouched, so the two run side
    by side), and how their logits on `ids` compare: the largest difference over the largest
    logit, and how often the two pick the same token."""
    import fuselab

    patched = copy.deepcopy(model)
    fuselab.patch(patched)
    before = model(ids).logits.float()
    after = patched(ids).logits.float()
    return patched, {"max_rel_diff": ((after - before).abs().max() / before.abs().max()).item(),
                     "argmax_agreement": (after.argmax(-1) == before.argmax(-1)).float().mean().item()}


def decode_step(model, ids: torch.Tensor) -> Callable[[], None]:
    """One decode step of the model over a growing dynamic cache, for the doctor."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
    state = {"cache": out.past_key_values, "token": out.logits[:, -1:].argmax(-1)}

    def step() -> None:
        with torch.no_grad():
            out = model(state["token"], past_key_values=state["cache"], use_cache=True)
        state["token"] = out.logits[:, -1:].argmax(-1)

    return step
