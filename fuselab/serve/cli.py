"""`fuselab serve MODEL`: the engine behind an OpenAI-compatible HTTP server (the serve extra)."""

from __future__ import annotations

import argparse
import os
import sys

from fuselab.engine.cli import QUANTIZATION_CHOICES

DESCRIPTION = (
    "Serve a local Hugging Face checkpoint directory or a preset (tiny, llama3-1b, llama3-8b, qwen3-0.6b; random "
    "weights, prompts read as UTF-8 bytes) over an OpenAI-compatible HTTP API: POST /v1/completions and "
    "/v1/chat/completions (streamed as server-sent events with \"stream\": true), GET /v1/models, /health and "
    "/metrics (Prometheus). Requests from every client share one continuously batched engine. Listens on "
    "127.0.0.1 unless --host says otherwise. Needs the serve extra: pip install 'fuselab[serve]'."
)
API_KEY_ENV = "FUSELAB_API_KEY"


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine (completions, chat, "
                                     "streaming, metrics)", description=DESCRIPTION)
    p.add_argument("model", metavar="MODEL", help="checkpoint directory, or a preset: tiny, llama3-1b, llama3-8b, "
                                                  "qwen3-0.6b")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV} if set, "
                        "else no key)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: MODEL as given)")
    p.add_argument("--mode", choices=("eager", "fused", "graphs"), default=None,
                   help="eager: torch ops; fused: fuselab kernels; graphs: fused, each decode step replayed from a "
                        "CUDA graph. Default graphs on a GPU, eager on a CPU")
    p.add_argument("--max-num-seqs", type=int, default=256, metavar="N",
                   help="requests in the running batch at most (default 256)")
    p.add_argument("--max-waiting", type=int, default=1024, metavar="N",
                   help="requests waiting beyond the running batch at most; past that the server answers 503 "
                        "(default 1024)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N", help="prompt + output tokens at most")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat template to use instead of the checkpoint's")
    p.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                   help="quantize every linear layer's weight as the model loads: int4 (group 128; int4-g64, int4-g32 "
                        "for smaller groups), int8 (per channel) or fp8 (e4m3, per channel); a GPTQ checkpoint is "
                        "served quantized without it")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N GPUs, one process each (on the CPU: N gloo ranks) (default 1)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info)")


def run_serve(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"fuselab serve: {message}", file=sys.stderr)
        return 2

    try:
        import uvicorn

        from fuselab.serve.app import build_app
        from fuselab.serve.chat_template import ChatTemplate
    except ImportError as err:
        return fail(f"{err.name} is missing: the server needs the serve extra, pip install 'fuselab[serve]'")
    from fuselab.device import has_cuda
    from fuselab.engine import LLM

    try:
        source = None
        if args.chat_template is not None:
            with open(args.chat_template, encoding="utf-8") as f:
                source = f.read()
        llm = LLM(args.model, mode=args.mode or ("graphs" if has_cuda() else "eager"), dtype=args.dtype,
                  device=args.device, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                  quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size)
        app = build_app(llm, args.served_model_name or args.model, api_key=args.api_key or os.environ.get(API_KEY_ENV),
                        max_waiting=args.max_waiting,
                        chat_template=source and ChatTemplate.from_dir(llm.engine_config.model_dir, source))
    except (ValueError, TypeError, OSError) as err:
        return fail(str(err))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
