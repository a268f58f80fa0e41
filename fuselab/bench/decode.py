"""`fuselab bench decode`: LLM decode speed, side by side in one run on one GPU.

For a Llama shape with random weights (bf16, nothing downloaded), a prompt of --prompt-len tokens
and --new-tokens greedy new tokens per sequence, at each batch size:

- hf: Hugging Face transformers, eager `generate`;
- hf-patch: the same model after `fuselab.patch` (its norms and MLP activation through fuselab's
  kernels), eager `generate`; its logits on the prompt are checked against hf's first;
- hf-compile: transformers with a static cache and torch.compile(mode="reduce-overhead") (its
  own fast path); its first call per batch size is compilation and timed apart;
- eager, fused, graphs: the fuselab engine in each mode.

Per mode: decode tok/s = batch · (new − 1) / (time(new) − time(first token)), time to first token,
inter-token latency p50/p99, kernels per decode step, and "bandwidth achieved": the rate over the
roofline's (every weight once, plus the KV cache at the mean context, over `fuselab probe`'s copy
bandwidth). Then the doctor's breakdown of one decode step of each mode at the smallest batch.

With --quantization int4,int8,fp8 the engine's fused and graphs modes run again on each format
(the same random weights, quantized), side by side with bf16: bandwidth against the quantized
bytes, the weights' GPU bytes, and the quality of the logits against bf16 (bench/decode_quant.py).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from fuselab.bench import batch_sizes, command_line, decode_quant, error_text, output_dir, positive_int, write_json
from fuselab.bench.decode_report import print_table, write_markdown, write_plot
from fuselab.bench.graphs import count_launches
from fuselab.device import ceilings, device_info, has_cuda

PRESETS = ("llama3-1b", "llama3-8b")
MODES = ("hf", "hf-patch", "hf-compile", "eager", "fused", "graphs")
HF_MODES = ("hf", "hf-patch", "hf-compile")
BATCH_SWEEP = [1, 8, 64, 256]
DTYPE = torch.bfloat16
# The doctor's step is one engine step drawn from a long stream: enough tokens for its warm-up,
# profiled steps and unprofiled timing.
DOCTOR_TOKENS = 2048
DOCTOR_STEPS = 5


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"modes must be comma-separated names among {', '.join(MODES)}; got {text!r}")
    return [m for m in MODES if m in modes]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESETS, default="llama3-1b", help="model shape (default llama3-1b)")
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[1], metavar="B1,B2,...",
                        help="batch sizes to measure (default 1)")
    parser.add_argument("--batch-sweep", action="store_const", const=BATCH_SWEEP, dest="batch_sizes",
                        help=f"measure batch sizes {','.join(map(str, BATCH_SWEEP))}")
    parser.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens per sequence (default 128)")
    parser.add_argument("--new-tokens", type=positive_int, default=256, help="new tokens per sequence (default 256)")
    parser.add_argument("--modes", type=_modes, default=list(MODES), metavar="M1,M2,...",
                        help=f"modes to run, among {','.join(MODES)} (default all)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    parser.add_argument("--quick", action="store_true", help="32 new tokens and no doctor: a rough result in a minute")
    parser.add_argument("--quantization", type=decode_quant.formats, default=[], metavar="F1,F2,...",
                        help="also run the engine's fused and graphs modes with weights quantized to each format "
                             f"({', '.join(decode_quant.QUANTIZATION_CHOICES)}), and compare their logits with bf16")
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                        help="run the engine's modes over N GPUs (its roofline: N GPUs' bandwidth; no kernel count "
                             "or doctor, whose kernels run in the ranks' processes); default 1")
    parser.add_argument("--out", type=output_dir, default="benchmarks/results", metavar="DIR",
                        help="folder for decode.json, decode.md and decode.png (default benchmarks/results)")


# --------------------------------------------------------------------------------------------
# What a step must read
# --------------------------------------------------------------------------------------------


def model_bytes(preset: str) -> tuple[int, int]:
    """(bytes of every weight, bytes of the KV cache per token), bf16: the roofline's inputs."""
    from fuselab.engine.config import ModelConfig

    c = ModelConfig.preset(preset)
    per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    params = c.num_layers * per_layer + embeddings + c.hidden_size
    return params * DTYPE.itemsize, 2 * c.num_layers * c.kv_size * DTYPE.itemsize


def roofline_tok_s(preset: str, batch: int, context: float, bandwidth_gbs: float,
                   weight_bytes: int | None = None) -> float:
    """Decode tok/s if a step took only the time to read every weight once (weight_bytes of them,
    default the bf16 model's) and each sequence's KV."""
    weights, kv_per_token = model_bytes(preset)
    step_bytes = (weights if weight_bytes is None else weight_bytes) + batch * context * kv_per_token
    return batch * bandwidth_gbs * 1e9 / step_bytes


# --------------------------------------------------------------------------------------------
# Hugging Face transformers
# --------------------------------------------------------------------------------------------


def build_hf(preset: str):
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


class _TokenClock:
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


def _hf_generate(model, input_ids: torch.Tensor, new_tokens: int) -> tuple[float, list[float]]:
    """(start, host time of each new token) of one greedy generate."""
    clock = _TokenClock()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, streamer=clock)
    torch.cuda.synchronize()
    return start, clock.times


def _hf_decode_step(model, input_ids: torch.Tensor) -> Callable[[], None]:
    """One decode step of the model over a growing dynamic cache, for the doctor."""
    with torch.no_grad():
        out = model(input_ids, use_cache=True)
    state = {"cache": out.past_key_values, "token": out.logits[:, -1:].argmax(-1)}

    def step() -> None:
        with torch.no_grad():
            out = model(state["token"], past_key_values=state["cache"], use_cache=True)
        state["token"] = out.logits[:, -1:].argmax(-1)

    return step


# --------------------------------------------------------------------------------------------
# fuselab
# --------------------------------------------------------------------------------------------


BLOCK_SIZE = 16


def build_llm(preset: str, mode: str, max_batch: int, max_model_len: int, tokens_held: int,
              quantization: str | None = None, tensor_parallel_size: int = 1):
    """An engine whose KV cache holds `tokens_held` tokens (in whole blocks per sequence) and no more:
    the memory left is the CUDA graphs' and the next mode's."""
    from fuselab.engine import LLM

    return LLM(preset, mode=mode, dtype="bfloat16", max_num_seqs=max_batch, max_model_len=max_model_len,
               block_size=BLOCK_SIZE, num_kv_blocks=-(-tokens_held // BLOCK_SIZE), quantization=quantization,
               tensor_parallel_size=tensor_parallel_size)


@contextmanager
def engine_step(llm, prompts: list[list[int]], max_tokens: int) -> Iterator[Callable[[], None]]:
    """One engine decode step: the next len(prompts) tokens of a stream, once every sequence decodes.
    The stream's requests are dropped on exit."""
    from fuselab.engine import SamplingParams

    stream = llm.generate_stream(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    try:
        seen = [0] * len(prompts)
        while min(seen) < 2:  # every prompt prefilled and decoding
            seen[next(stream).index] += 1

        def step() -> None:
            for _ in prompts:
                next(stream)

        yield step
    finally:
        stream.close()


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


def _row(mode: str, batch: int, first_times: list[float], last_times: list[float], itls: list[float],
         ttfts: list[float], new_tokens: int) -> dict:
    # Every sequence decodes in lockstep once the last one has its first token.
    decode_s = max(last_times) - max(first_times)
    itls_ms = sorted(1e3 * t for t in itls)
    return {
        "mode": mode, "batch": batch,
        "decode_tok_s": batch * (new_tokens - 1) / decode_s if decode_s > 0 else None,
        "ttft_ms": 1e3 * statistics.median(ttfts),
        "itl_p50_ms": statistics.median(itls_ms) if itls_ms else None,
        "itl_p99_ms": itls_ms[min(len(itls_ms) - 1, int(0.99 * len(itls_ms)))] if itls_ms else None,
    }


def measure_hf(mode: str, model, batch: int, args: argparse.Namespace) -> dict:
    ids = torch.tensor(_prompts(batch, args.prompt_len, model.config.vocab_size), device="cuda")
    compile_s = None
    if mode == "hf-compile":
        start = time.perf_counter()
        _hf_generate(model, ids, args.new_tokens)  # compiles and records graphs for this batch size
        compile_s = time.perf_counter() - start
    else:
        _hf_generate(model, ids, 8)  # warm-up: cuBLAS handles, allocator
    start, times = _hf_generate(model, ids, args.new_tokens)
    row = _row(mode, batch, [times[0]], [times[-1]], [b - a for a, b in zip(times, times[1:])],
               [times[0] - start], args.new_tokens)
    # A whole generate's kernels over its tokens (its prefill is one token's share). The compiled
    # path keeps its length (another would make the static cache another shape and compile again);
    # eager profiles a short one, as its hundreds of kernels a step make long traces slow to record.
    n = args.new_tokens if mode == "hf-compile" else min(args.new_tokens, 17)
    kernels = count_launches(lambda: _hf_generate(model, ids, n))["kernels"]
    row.update(kernels_per_step=kernels / n, compile_s=compile_s)
    return row


def measure_fuselab(llm, batch: int, args: argparse.Namespace) -> dict:
    from fuselab.engine import SamplingParams

    prompts = _prompts(batch, args.prompt_len, llm.config.vocab_size)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    m = [o.metrics for o in outputs]
    row = _row(llm.mode, batch, [x.ttft_s for x in m], [x.latency_s for x in m],
               [t for x in m for t in x.inter_token_latencies_s], [x.ttft_s for x in m], args.new_tokens)
    if llm.model is None:  # tensor-parallel: the kernels run in the ranks' processes, not here
        row.update(kernels_per_step=None, compile_s=llm.runner.capture_s)
        return row
    with engine_step(llm, prompts, max_tokens=64) as step:
        row["kernels_per_step"] = count_launches(step)["kernels"]
    row["compile_s"] = None if llm.runner.graphs is None else llm.runner.graphs.capture_s
    return row


def diagnose_step(step: Callable[[], None]) -> dict:
    """The doctor's findings on one decode step (a failure here fails the mode, whose rates stay)."""
    from fuselab.doctor import diagnose

    d = diagnose(step, steps=DOCTOR_STEPS, warmup=2, progress=False)
    return {"verdict": d.verdict, "wall_us_per_step": d.unprofiled_us_per_step or d.wall_us_per_step,
            "kernels_per_step": d.kernels_per_step, "syncs_per_step": d.syncs_per_step,
            "gpu_busy_pct": d.gpu_busy_pct, "breakdown": d.breakdown,
            "first_fix": d.fixes[0].action if d.fixes else None}


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@torch.no_grad()
def patch_and_compare(model, prompt_len: int) -> dict:
    """fuselab.patch(model), and how its logits on one prompt compare with the unpatched model's:
    the largest difference over the largest logit, and how often the two pick the same token."""
    import fuselab

    ids = torch.tensor(_prompts(1, prompt_len, model.config.vocab_size), device=model.device)
    before = model(ids).logits.float()
    fuselab.patch(model)
    after = model(ids).logits.float()
    return {"max_rel_diff": ((after - before).abs().max() / before.abs().max()).item(),
            "argmax_agreement": (after.argmax(-1) == before.argmax(-1)).float().mean().item()}


def _measure_hf_mode(mode: str, args: argparse.Namespace, rows: list[dict], doctor: dict) -> None:
    model = build_hf(args.preset)
    extra = {}
    if mode == "hf-patch":
        extra["logits_vs_hf"] = patch_and_compare(model, args.prompt_len)
    if mode == "hf-compile":
        # transformers' own fast path: with a static cache, generate compiles the decoding forward
        # itself (its CompileConfig, reduce-overhead). Compiling model.forward on top of that nests
        # two CUDA-graph trees, whose outputs overwrite each other.
        from transformers import CompileConfig

        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = CompileConfig(mode="reduce-overhead")
    for batch in args.batch_sizes:
        rows.append({**measure_hf(mode, model, batch, args), **extra})
        print(f"{mode} batch {batch}: {rows[-1]['decode_tok_s']:.1f} tok/s", flush=True)
    if mode == "hf" and not args.quick:
        batch = min(args.batch_sizes)
        ids = torch.tensor(_prompts(batch, args.prompt_len, model.config.vocab_size), device="cuda")
        doctor[mode] = diagnose_step(_hf_decode_step(model, ids))


def _measure_engine_mode(mode: str, args: argparse.Namespace, rows: list[dict], doctor: dict,
                         quantization: str | None = None) -> None:
    from fuselab.engine.quantize import weight_bytes

    doctor_batch = min(args.batch_sizes)
    max_len = args.prompt_len + max(args.new_tokens, DOCTOR_TOKENS) + BLOCK_SIZE
    seq_blocks = -(-(args.prompt_len + args.new_tokens + 1) // BLOCK_SIZE) + 1
    held = BLOCK_SIZE * max(max(args.batch_sizes) * seq_blocks, doctor_batch * -(-max_len // BLOCK_SIZE))
    llm = build_llm(args.preset, mode, max(args.batch_sizes), max_len, held, quantization, args.tensor_parallel_size)
    label = mode if quantization is None else f"{mode} {quantization}"
    extra = {"quantization": quantization or "bf16",
             "weights_gb": None if llm.model is None else weight_bytes(llm.model) / 1e9}
    if quantization is not None:
        extra["step_weight_bytes"] = decode_quant.step_bytes(llm.model, model_bytes(args.preset)[0])
    for batch in args.batch_sizes:
        rows.append({**measure_fuselab(llm, batch, args), **extra})
        print(f"{label} batch {batch}: {rows[-1]['decode_tok_s']:.1f} tok/s", flush=True)
    # A quantized fused mode's doctor would stream DOCTOR_TOKENS host-bound steps to say what bf16's said.
    if not args.quick and llm.model is not None and (quantization is None or mode == "graphs"):
        prompts = _prompts(doctor_batch, args.prompt_len, llm.config.vocab_size)
        with engine_step(llm, prompts, max_tokens=DOCTOR_TOKENS) as step:
            doctor[label] = diagnose_step(step)


def measure(args: argparse.Namespace) -> dict:
    modes = [m for m in args.modes if not (args.no_hf and m in HF_MODES)]
    new_tokens = 32 if args.quick else args.new_tokens
    args.new_tokens = new_tokens
    roof = ceilings()
    context = args.prompt_len + new_tokens / 2  # the mean context a decode step reads
    rows, doctor, failed = [], {}, {}
    for mode in modes:
        print(f"{mode}: building", flush=True)
        try:
            (_measure_hf_mode if mode in HF_MODES else _measure_engine_mode)(mode, args, rows, doctor)
        except Exception as err:  # noqa: BLE001
            # One mode's failure (a baseline's compiler, say) costs its own rows, not the run's.
            failed[mode] = error_text(err, limit=None)
            traceback.print_exc()
            print(f"{mode} failed: {failed[mode]}; going on with the other modes", flush=True)
        _release()
    quality = decode_quant.measure(args, modes, rows, doctor, failed, _measure_engine_mode, _release)
    for row in rows:
        ranks = 1 if row["mode"] in HF_MODES else args.tensor_parallel_size  # each reads its share of the bytes
        row["roofline_tok_s"] = roofline_tok_s(args.preset, row["batch"], context, ranks * roof.copy_bandwidth_gbs,
                                               row.get("step_weight_bytes"))
        row["bandwidth_pct"] = None if row["decode_tok_s"] is None else 100 * row["decode_tok_s"] / row["roofline_tok_s"]
    weights, kv_per_token = model_bytes(args.preset)
    return {
        "header": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "device": device_info().to_dict(), "command": command_line()},
        "config": {"preset": args.preset, "dtype": "bfloat16", "prompt_len": args.prompt_len, "new_tokens": new_tokens,
                   "batch_sizes": args.batch_sizes, "modes": modes, "weight_bytes": weights,
                   "kv_bytes_per_token": kv_per_token, "mean_context": context,
                   "copy_bandwidth_gbs": roof.copy_bandwidth_gbs, "ceilings_source": roof.source,
                   "doctor_batch": min(args.batch_sizes), "quantization": args.quantization,
                   "tensor_parallel_size": args.tensor_parallel_size},
        "rows": rows,
        "doctor": doctor,
        "failed": failed,
        "quality": quality,
    }



def run(args: argparse.Namespace) -> int:
    if not has_cuda():
        print("fuselab bench decode needs a CUDA GPU: it times LLM decoding on one. Nothing was measured.")
        return 0
    result = measure(args)
    print_table(result)
    out = Path(args.out)
    write_json(result, out, "decode")
    write_markdown(result, out / "decode.md")
    write_plot(result, out / "decode.png")
    print(f"wrote {out / 'decode.json'}, {out / 'decode.md'}, {out / 'decode.png'}")
    return 1 if result["failed"] else 0
