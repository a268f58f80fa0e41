"""`fuselab bench serve`: the HTTP server under load, in the manner of vLLM's serving benchmark.

At each rate of --request-rates, --num-requests requests arrive as a Poisson process (inf: all at
once), each a random token-id prompt of about --prompt-len tokens asking for about --output-len
new tokens (lengths uniform within ±--len-spread of those; the same draws at every rate; greedy,
ignore_eos, so each request makes all its tokens), streamed from /v1/completions. Per rate:
request and token throughput over the run, time to first token, inter-token latency (between
streamed chunks, as vLLM measures it; a chunk holds every token the server had when it wrote
it), time per output token ((latency - TTFT) / (tokens - 1)) and end-to-end latency, p50 and p99.

The server is `fuselab serve` started here in a process of its own, as it runs in production,
unless --url names one already running (--model then only gives the vocabulary for the prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from fuselab.bench import command_line, fmt, markdown_table, non_negative_float, output_dir, positive_int, write_json
from fuselab.device import device_info, has_cuda

DEFAULT_RATES = [1.0, 4.0, 16.0, math.inf]
CPU_MODELS = ("tiny",)  # what runs on a CPU: a smoke test of the load generator and the server
STARTUP_TIMEOUT_S = 900
SLOWEST = 5  # requests of each rate's TTFT tail named in the JSON  # loading an 8B checkpoint and capturing its CUDA graphs


def _rates(text: str) -> list[float]:
    try:
        rates = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated request rates (per second, or inf), got {text!r}") \
            from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"request rates must be > 0, got {text!r}")
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama3-1b", metavar="DIR_OR_PRESET",
                        help="checkpoint directory or preset to serve (default llama3-1b; on a CPU only tiny runs)")
    parser.add_argument("--url", default=None, help="measure this running server instead of starting one, e.g. "
                                                    "http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, metavar="KEY", help="the running server's API key, with --url")
    parser.add_argument("--request-rates", type=_rates, default=DEFAULT_RATES, metavar="R1,R2,...",
                        help="request arrival rates per second to sweep; inf sends every request at once "
                             "(default 1,4,16,inf)")
    parser.add_argument("--num-requests", type=positive_int, default=200, metavar="N", help="requests per rate (default 200)")
    parser.add_argument("--prompt-len", type=positive_int, default=256, metavar="N", help="prompt tokens, mean (default 256)")
    parser.add_argument("--output-len", type=positive_int, default=128, metavar="N", help="new tokens, mean (default 128)")
    parser.add_argument("--len-spread", type=non_negative_float, default=0.25, metavar="S",
                        help="lengths are uniform in [mean * (1 - S), mean * (1 + S)] (default 0.25; 0: fixed)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=256, metavar="N",
                        help="the started server's running batch at most (default 256)")
    parser.add_argument("--mode", choices=("eager", "fused", "graphs"), default=None,
                        help="the started server's engine mode (default graphs on a GPU, eager on a CPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths, prompts and arrivals (default 0)")
    parser.add_argument("--out", type=output_dir, default="benchmarks/results", metavar="DIR",
                        help="folder for serve.json, serve.md and serve.png (default benchmarks/results)")


# --------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------


def _lengths(rng: random.Random, mean: int, spread: float, count: int) -> list[int]:
    low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return [rng.randint(low, high) for _ in range(count)]


def workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) of each request, the same at every rate."""
    rng = random.Random(args.seed)
    prompt_lens = _lengths(rng, args.prompt_len, args.len_spread, args.num_requests)
    output_lens = _lengths(rng, args.output_len, args.len_spread, args.num_requests)
    return [([rng.randrange(vocab_size) for _ in range(p)], o) for p, o in zip(prompt_lens, output_lens)]


def arrivals(rate: float, count: int, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process of `rate` per second."""
    if math.isinf(rate):
        return [0.0] * count
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _max_model_len(args: argparse.Namespace) -> int:
    longest = sum(max(1, round(n * (1 + args.len_spread))) for n in (args.prompt_len, args.output_len))
    return longest + 1


# --------------------------------------------------------------------------------------------
# The load generator
# --------------------------------------------------------------------------------------------


async def _request(client, url: str, body: dict, start: float) -> dict:
    """One streamed completion: when each chunk came, how many tokens, or what went wrong."""
    times, tokens = [], None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False, "error": chunk["error"].get("message")}
                if chunk.get("choices"):
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as err:  # noqa: BLE001 - a failed request is counted, not fatal
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}
    if not times or tokens is None:
        return {"ok": False, "error": "the stream ended without tokens or usage"}
    return {"ok": True, "ttft": times[0] - start, "latency": times[-1] - start, "tokens": tokens,
            "itls": [b - a for a, b in zip(times, times[1:])]}


async def run_rate(base_url: str, model: str, requests: list[tuple[list[int], int]], rate: float, seed: int,
                   api_key: str | None = None) -> dict:
    """Send `requests` at `rate` and gather what each saw."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=None) as client:
        start = time.perf_counter()

        async def send(at: float, prompt: list[int], max_tokens: int) -> dict:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            sent = time.perf_counter()
            return {**await _request(client, base_url + "/v1/completions", body, sent), "prompt_tokens": len(prompt),
                    "arrival_s": at}

        results = await asyncio.gather(*(send(at, p, n) for at, (p, n) in
                                         zip(arrivals(rate, len(requests), seed), requests)))
        for index, result in enumerate(results):
            result["index"] = index
        duration = time.perf_counter() - start
    return summarize(rate, results, duration)


def _percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks, as numpy.percentile does."""
    if not values:
        return None
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


def summarize(rate: float, results: list[dict], duration_s: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [1e3 * r["ttft"] for r in ok]
    itl = [1e3 * x for r in ok for x in r["itls"]]
    tpot = [1e3 * (r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    e2e = [1e3 * r["latency"] for r in ok]
    output_tokens = sum(r["tokens"] for r in ok)
    row = {"request_rate": "inf" if math.isinf(rate) else rate, "completed": len(ok),
           "failed": len(results) - len(ok), "duration_s": duration_s,
           "request_throughput": len(ok) / duration_s,
           "output_throughput": output_tokens / duration_s,
           "total_token_throughput": (output_tokens + sum(r["prompt_tokens"] for r in ok)) / duration_s,
           "errors": sorted({r["error"] for r in results if not r["ok"]})[:5]}
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl), ("tpot_ms", tpot), ("e2e_ms", e2e)):
        row[f"{name}_mean"] = sum(values) / len(values) if values else None
        row[f"{name}_p50"], row[f"{name}_p99"] = _percentile(values, 50), _percentile(values, 99)
    # The tail's requests by name: whether a slow first token is the first requests' (warm-up) or load's.
    row["slowest_ttft"] = [{"index": r.get("index"), "arrival_s": r.get("arrival_s"),
                            "prompt_tokens": r["prompt_tokens"], "ttft_ms": 1e3 * r["ttft"]}
                           for r in sorted(ok, key=lambda r: -r["ttft"])[:SLOWEST]]
    return row


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`fuselab serve` in a process of its own, once its /health answers; (process, base URL)."""
    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "fuselab", "serve", str(args.model), "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(_max_model_len(args)),
               "--max-waiting", str(args.num_requests), "--log-level", "warning"]
    if args.mode:
        command += ["--mode", args.mode]
    process = subprocess.Popen(command, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"`{' '.join(command)}` exited with {process.returncode} before serving")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    stop_server(process)
    raise RuntimeError(f"the server did not answer /health within {STARTUP_TIMEOUT_S} s")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _served_model(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(url + "/v1/models", headers=headers, timeout=30).raise_for_status().json()["data"][0]["id"]


def measure(args: argparse.Namespace) -> dict:
    from fuselab.engine.engine_config import EngineConfig

    vocab_size = EngineConfig(args.model, mode="eager", device="cpu").model_config.vocab_size
    requests = workload(args, vocab_size)
    process, url = (None, args.url.rstrip("/")) if args.url else start_server(args)
    try:
        model = _served_model(url, args.api_key)
        # Warm-up: the first requests pay for allocator growth and, in fused mode, kernel compilation.
        asyncio.run(run_rate(url, model, requests[: min(4, len(requests))], math.inf, args.seed, args.api_key))
        rows = []
        for i, rate in enumerate(args.request_rates):
            rows.append(asyncio.run(run_rate(url, model, requests, rate, args.seed + i, args.api_key)))
            r = rows[-1]
            print(f"rate {r['request_rate']}: {r['completed']} done, {r['failed']} failed, "
                  f"{r['output_throughput']:.1f} tok/s, TTFT p50 {fmt(r['ttft_ms_p50'], '.1f')} ms", flush=True)
    finally:
        if process is not None:
            stop_server(process)
    return {
        "header": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "device": device_info().to_dict(), "command": command_line()},
        "config": {"model": str(args.model), "served_model": model, "url": args.url, "num_requests": args.num_requests,
                   "prompt_len": args.prompt_len, "output_len": args.output_len, "len_spread": args.len_spread,
                   "max_num_seqs": None if args.url else args.max_num_seqs, "mode": args.mode, "seed": args.seed,
                   "request_rates": ["inf" if math.isinf(r) else r for r in args.request_rates]},
        "rows": rows,
    }


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

COLUMNS = ["rate req/s", "done", "failed", "req/s", "output tok/s", "total tok/s", "TTFT p50 ms", "TTFT p99 ms",
           "ITL p50 ms", "ITL p99 ms", "TPOT p50 ms", "E2E p50 ms"]


def _table_rows(result: dict) -> list[list[str]]:
    return [[str(r["request_rate"]), str(r["completed"]), str(r["failed"]), fmt(r["request_throughput"], ".2f"),
             fmt(r["output_throughput"], ".1f"), fmt(r["total_token_throughput"], ".1f"), fmt(r["ttft_ms_p50"], ".1f"),
             fmt(r["ttft_ms_p99"], ".1f"), fmt(r["itl_ms_p50"], ".2f"), fmt(r["itl_ms_p99"], ".2f"),
             fmt(r["tpot_ms_p50"], ".2f"), fmt(r["e2e_ms_p50"], ".0f")] for r in result["rows"]]


def _describe(result: dict) -> str:
    c = result["config"]
    return (f"{c['served_model']}, {c['num_requests']} requests per rate, prompt ~{c['prompt_len']} and output "
            f"~{c['output_len']} tokens (±{100 * c['len_spread']:.0f}%), greedy, ignore_eos, streamed")


def write_markdown(result: dict, path: Path) -> None:
    h, d = result["header"], result["header"]["device"]
    lines = ["# fuselab bench serve", "",
             f"- date: {h['date']}",
             f"- device: {d['name']} (torch {d['torch']}, triton {d['triton']}, CUDA {d['cuda']}, "
             f"Python {d['python']})",
             f"- command: `{h['command']}`",
             f"- workload: {_describe(result)}; Poisson arrivals at each rate (inf: all at once)",
             "- ITL: between streamed chunks; TPOT: (latency − TTFT) / (tokens − 1) per request; throughput over "
             "the whole run of a rate", "",
             *markdown_table(COLUMNS, _table_rows(result))]
    lines += [f"- rate {r['request_rate']}: {r['failed']} failed: {'; '.join(r['errors'])}"
              for r in result["rows"] if r["failed"]]
    path.write_text("\n".join(lines) + "\n")


def write_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs, labels = range(len(rows)), [str(r["request_rate"]) for r in rows]
    fig, (tput, ttft, itl) = plt.subplots(1, 3, figsize=(14, 4))
    tput.plot(xs, [r["output_throughput"] for r in rows], "o-", label="output tok/s")
    tput.plot(xs, [r["total_token_throughput"] for r in rows], "s--", label="total tok/s")
    for ax, key, title in ((ttft, "ttft_ms", "time to first token, ms"), (itl, "itl_ms", "inter-token latency, ms")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(xs, [r[f"{key}_{q}"] or 0 for r in rows], style, label=q)
        ax.set(title=title)
    tput.set(title="throughput")
    for ax in (tput, ttft, itl):
        ax.set_xticks(list(xs), labels)
        ax.set_xlabel("request rate, req/s")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"fuselab serve: {result['config']['served_model']} on {result['header']['device']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 150)  # a pipe reports 80 columns, which would cut the table's cells
    table = Table(title=f"fuselab bench serve: {_describe(result)}")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for row in _table_rows(result):
        table.add_row(*row)
    console.print(table)


def run(args: argparse.Namespace) -> int:
    if args.url is None and not has_cuda() and args.model not in CPU_MODELS:
        print(f"fuselab bench serve needs a CUDA GPU to serve {args.model}: it measures the server under load. "
              f"Nothing was measured. (On a CPU, --model tiny runs a smoke test.)")
        return 0
    for name in ("num_requests", "prompt_len", "output_len", "max_num_seqs"):
        if getattr(args, name) < 1:
            print(f"fuselab bench serve: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if not 0 <= args.len_spread < 1:
        print("fuselab bench serve: --len-spread must be in [0, 1)", file=sys.stderr)
        return 2
    result = measure(args)
    print_table(result)
    out = Path(args.out)
    write_json(result, out, "serve")
    write_markdown(result, out / "serve.md")
    write_plot(result, out / "serve.png")
    print(f"wrote {out / 'serve.json'}, {out / 'serve.md'}, {out / 'serve.png'}")
    return 1 if any(r["failed"] for r in result["rows"]) else 0
