"""`fuselab generate`: text from a local checkpoint or a preset, streamed as it is produced."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fuselab.engine.tokenizer import TOKENIZER_FILE

# Spelled here rather than imported from fuselab.engine.quantize, which loads torch: `fuselab
# --help` stays quick. tests/test_quant_engine.py checks the two agree.
QUANTIZATION_CHOICES = ("int4", "int4-g32", "int4-g64", "int4-g128", "int8", "fp8")

if TYPE_CHECKING:
    from fuselab.engine.config import ModelConfig

DESCRIPTION = (
    "Generate text with the fuselab engine from a local Hugging Face checkpoint directory (config.json, "
    "*.safetensors, tokenizer.json) or a preset with random weights (tiny, llama3-1b, llama3-8b, qwen3-0.6b). "
    "Presets have no tokenizer: their prompts are read as UTF-8 bytes (token id = byte value), and since their "
    "weights are random, so is the text. A checkpoint without tokenizer.json takes --prompt-ids and prints token "
    "ids. One prompt streams its tokens as they come; several are batched together and printed in order. Greedy "
    "unless --temperature is above 0."
)


def _token_ids(text: str) -> list[int]:
    """An argparse type: comma-separated token ids (ints >= 0); the vocabulary is checked once the model is known."""
    try:
        ids = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if any(t < 0 for t in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a local checkpoint or a preset (continuous batching, "
                                        "paged KV cache)", description=DESCRIPTION)
    p.add_argument("--model", required=True, metavar="DIR_OR_PRESET",
                   help="checkpoint directory, or a preset: tiny, llama3-1b, llama3-8b, qwen3-0.6b")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", metavar="TEXT",
                        help="prompt text; repeat for several prompts in one batch")
    prompt.add_argument("--prompt-ids", type=_token_ids, action="append", metavar="ID,ID,...",
                        help="a prompt as token ids, e.g. 1,2,3 (for a checkpoint without tokenizer.json); repeat "
                             "for several prompts in one batch")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="new tokens per prompt at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the likeliest tokens whose probability reaches P (1: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling, for repeatable draws")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-sequence token")
    p.add_argument("--mode", choices=("eager", "fused", "graphs"), default=None,
                   help="eager: torch ops; fused: fuselab kernels; graphs: fused, each decode step replayed from a CUDA graph. "
                        "Default graphs on a GPU, eager on a CPU (fused there runs Triton's interpreter: slow)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N", help="prompt + output tokens at most")
    p.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                   help="quantize every linear layer's weight as the model loads: int4 (group 128; int4-g64, int4-g32 "
                        "for smaller groups), int8 (per channel) or fp8 (e4m3, per channel). A GPTQ checkpoint is "
                        "read as quantized without it")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N GPUs, one process each (on the CPU: N gloo ranks); N must divide the "
                        "model's attention and KV heads (default 1)")


def _check_prompts(args: argparse.Namespace, model_dir: Path | None, config: ModelConfig) -> None:
    """Text prompts need a tokenizer; token ids must be in the vocabulary."""
    if args.prompt and model_dir is not None and not (model_dir / TOKENIZER_FILE).is_file():
        raise ValueError(f"argument --prompt: {str(model_dir)!r} has no {TOKENIZER_FILE}: give the prompt as token "
                         "ids with --prompt-ids")
    for ids in args.prompt_ids or ():
        bad = next((t for t in ids if t >= config.vocab_size), None)
        if bad is not None:
            raise ValueError(f"argument --prompt-ids: token id {bad} is outside the model's vocabulary "
                             f"[0, {config.vocab_size})")


def _printable(text: str) -> str:
    """Control characters escaped, so random bytes from a preset cannot upset the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def run_generate(args: argparse.Namespace) -> int:
    from fuselab.device import has_cuda
    from fuselab.engine import LLM, SamplingParams
    from fuselab.engine.engine_config import resolve_model

    mode = args.mode or ("graphs" if has_cuda() else "eager")
    prompts = args.prompt or args.prompt_ids
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, seed=args.seed)
        _check_prompts(args, *resolve_model(args.model))  # from config.json alone, before the weights are read
        llm = LLM(args.model, mode=mode, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                  quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size)
        if len(prompts) == 1:
            return _stream_one(llm, prompts[0], params)
        outputs = llm.generate(prompts, params)
    except (ValueError, TypeError) as e:
        # A bad option, model or checkpoint: its message names it, a traceback would add nothing.
        print(f"fuselab generate: error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outputs):
        m = out.metrics
        body = " ".join(map(str, out.token_ids)) if out.text is None else _printable(out.text)
        print(f"--- {prompt!r}\n{body}")
        print(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}, time to first token "
              f"{m.ttft_s * 1e3:.1f} ms, {m.latency_s * 1e3:.1f} ms in all]", file=sys.stderr)
    return 0


def _stream_one(llm, prompt: str | list[int], params) -> int:
    start = time.perf_counter()
    stream = llm.generate_stream(prompt, params)
    first = last = None
    count = 0
    for event in stream:
        last = time.perf_counter()
        first = first or last
        count += 1
        # Without a tokenizer there is no text: the ids themselves are the output.
        piece = f"{event.token_id} " if llm.tokenizer is None else _printable(event.text or "")
        print(piece, end="", flush=True)
        reason = event.finish_reason
    print()
    per_token = f", {(last - first) / (count - 1) * 1e3:.1f} ms per later token" if count > 1 else ""
    print(f"[{count} tokens, finish: {reason}, time to first token {(first - start) * 1e3:.1f} ms{per_token}]",
          file=sys.stderr)
    return 0
