"""`fuselab generate`: text from a local checkpoint or a preset, streamed as it is produced."""

from __future__ import annotations

import argparse
import sys
import time

DESCRIPTION = (
    "Generate text with the fuselab engine from a local Hugging Face checkpoint directory (config.json, "
    "*.safetensors, tokenizer.json) or a preset with random weights (tiny, llama3-1b, llama3-8b, qwen3-0.6b). "
    "Presets have no tokenizer: their prompts are read as UTF-8 bytes (token id = byte value), and since their "
    "weights are random, so is the text. One --prompt streams its tokens as they come; several are batched "
    "together and printed in order. Greedy unless --temperature is above 0."
)


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a local checkpoint or a preset (continuous batching, "
                                        "paged KV cache)", description=DESCRIPTION)
    p.add_argument("--model", required=True, metavar="DIR_OR_PRESET",
                   help="checkpoint directory, or a preset: tiny, llama3-1b, llama3-8b, qwen3-0.6b")
    p.add_argument("--prompt", required=True, action="append", metavar="TEXT",
                   help="prompt text; repeat for several prompts in one batch")
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


def _printable(text: str) -> str:
    """Control characters escaped, so random bytes from a preset cannot upset the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def run_generate(args: argparse.Namespace) -> int:
    from fuselab.device import has_cuda
    from fuselab.engine import LLM, SamplingParams

    mode = args.mode or ("graphs" if has_cuda() else "eager")

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, seed=args.seed)
        llm = LLM(args.model, mode=mode, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
        if len(args.prompt) == 1:
            return _stream_one(llm, args.prompt[0], params)
        outputs = llm.generate(args.prompt, params)
    except (ValueError, TypeError) as e:
        print(f"fuselab generate: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outputs):
        m = out.metrics
        print(f"--- {prompt!r}\n{_printable(out.text or '')}")
        print(f"[{len(out.token_ids)} tokens, finish: {out.finish_reason}, time to first token "
              f"{m.ttft_s * 1e3:.1f} ms, {m.latency_s * 1e3:.1f} ms in all]", file=sys.stderr)
    return 0


def _stream_one(llm, prompt: str, params) -> int:
    start = time.perf_counter()
    stream = llm.generate_stream(prompt, params)
    first = last = None
    count = 0
    for event in stream:
        last = time.perf_counter()
        first = first or last
        count += 1
        print(_printable(event.text or ""), end="", flush=True)
        reason = event.finish_reason
    print()
    per_token = f", {(last - first) / (count - 1) * 1e3:.1f} ms per later token" if count > 1 else ""
    print(f"[{count} tokens, finish: {reason}, time to first token {(first - start) * 1e3:.1f} ms{per_token}]",
          file=sys.stderr)
    return 0
