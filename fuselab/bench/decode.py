"""`fuselab bench decode`: LLM decode speed, side by side in one run on one GPU.

For a Llama shape with random weights (bf16, nothing downloaded), a prompt of --prompt-len tokens
and --new-tokens greedy new tokens per sequence, at each batch size:

- hf: Hugging Face transformers, eager `generate`;
- hf-patch: a deep copy of hf's model after `fuselab.patch` (its norms, MLP activation and rotary
  embedding through fuselab's kernels), eager `generate`; its logits on a prompt checked against hf's;
- hf-compile: transformers with a static cache and torch.compile(mode="reduce-overhead") (its
  own fast path); its first call per batch size is compilation and timed apart;
- eager, fused, graphs: the fuselab engine in each mode.

Decode tok/s = batch · (new − 1) / (T(new) − T(1)), T(n) the wall time of one whole generate of
n tokens a sequence: for transformers a plain `model.generate` as a user calls it (no streamer,
decode_hf.py), for the engine `LLM.generate`. Each mode first runs one generate of --new-tokens
(warm-up: the first pass over new context lengths runs slower; its rate is reported apart), then
--rounds rounds of T(1) and T(new); the row holds their median and range. hf, hf-patch and fused
(on one GPU) are built together and take turns within each round (hf, hf-patch, fused, hf, ...),
so that the host's speed, which moves during a run, weighs on each alike; their "vs hf" is the
median of the per-round ratios. Other rows' vs hf is the ratio of medians from the same run.

Then per mode, from one more generate: time to first token and inter-token latency p50/p99
(transformers: a streamer noting each token's arrival; the engine: its requests' metrics), kernels
per decode step, "bandwidth achieved" (the rate over the roofline's: every weight once, plus the
KV cache at the mean context, over `fuselab probe`'s copy bandwidth), and the doctor's breakdown of
one decode step of each mode at the smallest batch.

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
from datetime import datetime, timezone
from pathlib import Path
from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator

import torch

from fuselab.bench import batch_sizes, command_line, decode_hf, decode_quant, output_dir, positive_int, write_json
from fuselab.bench.decode_report import print_table, write_markdown, write_plot
from fuselab.bench.decode_rounds import Contender, attempt, measure_contenders
from fuselab.bench.graphs import count_launches
from fuselab.device import ceilings, device_info, has_cuda

PRESETS = ("llama3-1b", "llama3-8b")
MODES = ("hf", "hf-patch", "hf-compile", "eager", "fused", "graphs")
HF_MODES = ("hf", "hf-patch", "hf-compile")
INTERLEAVED = ("hf", "hf-patch", "fused")
BATCH_SWEEP = [1, 8, 64, 256]
DTYPE = decode_hf.DTYPE
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
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="timed rounds per mode and batch size; the row is their median, with their range "
                             "(default 3)")
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


def _latencies(ttfts: list[float], itls: list[float]) -> dict:
    itls_ms = sorted(1e3 * t for t in itls)
    return {
        "ttft_ms": 1e3 * statistics.median(ttfts),
        "itl_p50_ms": statistics.median(itls_ms) if itls_ms else None,
        "itl_p99_ms": itls_ms[min(len(itls_ms) - 1, int(0.99 * len(itls_ms)))] if itls_ms else None,
    }


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


def _hf_ids(model, batch: int, prompt_len: int) -> torch.Tensor:
    return torch.tensor(_prompts(batch, prompt_len, model.config.vocab_size), device=model.device)


def hf_contender(mode: str, model, args: argparse.Namespace, extra: dict | None = None) -> Contender:
    """A transformers mode: timed plain generates; latencies from a streamed one; the kernels of a
    generate over its tokens; the doctor on hf's step."""
    def timer(batch: int) -> Callable[[int], float]:
        ids = _hf_ids(model, batch, args.prompt_len)
        return lambda new_tokens: decode_hf.generate_s(model, ids, new_tokens)

    def extras(batch: int, first_s: float) -> dict:
        ids = _hf_ids(model, batch, args.prompt_len)
        ttft, itls = decode_hf.streamed_latencies(model, ids, args.new_tokens)
        kernels = decode_hf.kernels_per_step(model, ids, args.new_tokens, compiled=mode == "hf-compile")
        # The compiled path's first generate per batch size compiles and records its graphs.
        return {**_latencies([ttft], itls), **(extra or {}), "kernels_per_step": kernels,
                "compile_s": first_s if mode == "hf-compile" else None}

    def diagnose() -> dict:
        return diagnose_step(decode_hf.decode_step(model, _hf_ids(model, min(args.batch_sizes), args.prompt_len)))

    return Contender(mode, mode, timer, extras, diagnose if mode == "hf" else None)


def _measure_hf_mode(mode: str, args: argparse.Namespace, rows: list[dict], doctor: dict) -> None:
    model = decode_hf.build_hf(args.preset)
    extra = {}
    if mode == "hf-patch":  # the unpatched model serves the logits check only, then goes
        model, extra["logits_vs_hf"] = decode_hf.patched_copy(model, _hf_ids(model, 1, args.prompt_len))
    if mode == "hf-compile":
        decode_hf.use_compile_path(model)
    measure_contenders([hf_contender(mode, model, args, extra)], args, rows, doctor)


def _engine(mode: str, args: argparse.Namespace, quantization: str | None = None):
    """(an engine in `mode` sized for every batch size and the doctor's stream, its row's columns)."""
    from fuselab.engine.quantize import weight_bytes

    doctor_batch = min(args.batch_sizes)
    max_len = args.prompt_len + max(args.new_tokens, DOCTOR_TOKENS) + BLOCK_SIZE
    seq_blocks = -(-(args.prompt_len + args.new_tokens + 1) // BLOCK_SIZE) + 1
    held = BLOCK_SIZE * max(max(args.batch_sizes) * seq_blocks, doctor_batch * -(-max_len // BLOCK_SIZE))
    llm = build_llm(args.preset, mode, max(args.batch_sizes), max_len, held, quantization, args.tensor_parallel_size)
    extra = {"quantization": quantization or "bf16",
             "weights_gb": None if llm.model is None else weight_bytes(llm.model) / 1e9}
    if quantization is not None:
        extra["step_weight_bytes"] = decode_quant.step_bytes(llm.model, model_bytes(args.preset)[0])
    return llm, extra


def engine_contender(mode: str, llm, extra: dict, args: argparse.Namespace,
                     quantization: str | None = None) -> Contender:
    """An engine mode: timed generates; latencies from its requests' metrics in another one; the
    kernels of one decode step; the doctor on one step of a long stream."""
    from fuselab.engine import SamplingParams

    def params(new_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    def timer(batch: int) -> Callable[[int], float]:
        prompts = _prompts(batch, args.prompt_len, llm.config.vocab_size)

        def generate_s(new_tokens: int) -> float:
            start = time.perf_counter()
            llm.generate(prompts, params(new_tokens))  # returns the tokens on the host: nothing left running
            return time.perf_counter() - start

        return generate_s

    def extras(batch: int, first_s: float) -> dict:
        prompts = _prompts(batch, args.prompt_len, llm.config.vocab_size)
        metrics = [o.metrics for o in llm.generate(prompts, params(args.new_tokens))]
        row = {**_latencies([m.ttft_s for m in metrics], [t for m in metrics for t in m.inter_token_latencies_s]),
               **extra}
        if llm.model is None:  # tensor-parallel: the kernels run in the ranks' processes, not here
            return {**row, "kernels_per_step": None, "compile_s": llm.runner.capture_s}
        with engine_step(llm, prompts, max_tokens=64) as step:
            row["kernels_per_step"] = count_launches(step)["kernels"]
        row["compile_s"] = None if llm.runner.graphs is None else llm.runner.graphs.capture_s
        return row

    def diagnose() -> dict:
        prompts = _prompts(min(args.batch_sizes), args.prompt_len, llm.config.vocab_size)
        with engine_step(llm, prompts, max_tokens=DOCTOR_TOKENS) as step:
            return diagnose_step(step)

    label = mode if quantization is None else f"{mode} {quantization}"
    # A quantized fused mode's doctor would stream DOCTOR_TOKENS host-bound steps to say what bf16's said.
    doctored = llm.model is not None and (quantization is None or mode == "graphs")
    return Contender(label, mode, timer, extras, diagnose if doctored else None)


def _measure_engine_mode(mode: str, args: argparse.Namespace, rows: list[dict], doctor: dict,
                         quantization: str | None = None) -> None:
    llm, extra = _engine(mode, args, quantization)
    measure_contenders([engine_contender(mode, llm, extra, args, quantization)], args, rows, doctor)


def interleaved_modes(modes: list[str], tensor_parallel_size: int) -> list[str]:
    """The modes measured in turns, in one process: transformers eager with and without the patch,
    and the engine's fused mode on this GPU; none when fewer than two of them run (fused comes
    last in MODES, so a group of two or more starts with a transformers mode)."""
    together = [m for m in modes if m in INTERLEAVED and (m != "fused" or tensor_parallel_size == 1)]
    return together if len(together) > 1 else []


def _measure_interleaved(modes: list[str], args: argparse.Namespace, rows: list[dict], doctor: dict,
                         failed: dict[str, str]) -> None:
    """hf, a patched deep copy of its model (hf-patch) and the fused engine, all built first, then
    measured in turns (measure_contenders)."""
    contenders = []
    hf_modes = [m for m in modes if m in ("hf", "hf-patch")]
    model = attempt(hf_modes[0], failed, lambda: decode_hf.build_hf(args.preset))
    if model is None:
        failed.update({m: failed[hf_modes[0]] for m in hf_modes})
    else:
        if "hf" in modes:
            contenders.append(hf_contender("hf", model, args))
        if "hf-patch" in modes:
            patched = attempt("hf-patch", failed,
                               lambda: decode_hf.patched_copy(model, _hf_ids(model, 1, args.prompt_len)))
            if patched is not None:
                contenders.append(hf_contender("hf-patch", patched[0], args, {"logits_vs_hf": patched[1]}))
        del model  # without hf, the unpatched model served the logits check only
    if "fused" in modes:
        engine = attempt("fused", failed, lambda: _engine("fused", args))
        if engine is not None:
            contenders.append(engine_contender("fused", *engine, args))
    measure_contenders(contenders, args, rows, doctor, failed)


def _ratios_of_medians(rows: list[dict]) -> None:
    """vs hf for the rows measured apart from hf: the ratio of the two medians, same run."""
    hf = {r["batch"]: r["decode_tok_s"] for r in rows if r["mode"] == "hf"}
    for row in rows:
        if row["mode"] != "hf" and "vs_hf" not in row and hf.get(row["batch"]) and row["decode_tok_s"]:
            row["vs_hf"] = row["decode_tok_s"] / hf[row["batch"]]


def measure(args: argparse.Namespace) -> dict:
    modes = [m for m in args.modes if not (args.no_hf and m in HF_MODES)]
    new_tokens = 32 if args.quick else args.new_tokens
    args.new_tokens = new_tokens
    roof = ceilings()
    context = args.prompt_len + new_tokens / 2  # the mean context a decode step reads
    together = interleaved_modes(modes, args.tensor_parallel_size)
    rows, doctor, failed = [], {}, {}
    for mode in modes:
        if mode in together[1:]:
            continue
        if together and mode == together[0]:
            print(f"{', '.join(together)}: building, to be measured in turns", flush=True)
            _measure_interleaved(together, args, rows, doctor, failed)
        else:
            print(f"{mode}: building", flush=True)
            measure_mode = _measure_hf_mode if mode in HF_MODES else _measure_engine_mode
            attempt(mode, failed, partial(measure_mode, mode, args, rows, doctor))
        _release()
    quality = decode_quant.measure(args, modes, rows, doctor, failed, _measure_engine_mode, _release)
    for row in rows:
        ranks = 1 if row["mode"] in HF_MODES else args.tensor_parallel_size  # each reads its share of the bytes
        row["roofline_tok_s"] = roofline_tok_s(args.preset, row["batch"], context, ranks * roof.copy_bandwidth_gbs,
                                               row.get("step_weight_bytes"))
        row["bandwidth_pct"] = None if row["decode_tok_s"] is None else 100 * row["decode_tok_s"] / row["roofline_tok_s"]
    _ratios_of_medians(rows)
    weights, kv_per_token = model_bytes(args.preset)
    return {
        "header": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "device": device_info().to_dict(), "command": command_line()},
        "config": {"preset": args.preset, "dtype": "bfloat16", "prompt_len": args.prompt_len, "new_tokens": new_tokens,
                   "batch_sizes": args.batch_sizes, "modes": modes, "rounds": args.rounds, "interleaved": together,
                   "weight_bytes": weights, "kv_bytes_per_token": kv_per_token, "mean_context": context,
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
