"""`fuselab bench serve`: its options, its workload and statistics, and a smoke run on the CPU
against a `fuselab serve` subprocess of the tiny preset."""

from __future__ import annotations

import argparse
import json
import math
import statistics

import pytest
import torch

from fuselab.bench import serve as bench_serve
from fuselab.cli import main


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_options_parse():
    defaults = _args()
    assert defaults.model == "llama3-1b" and defaults.request_rates == [1, 4, 16, math.inf]
    assert (defaults.num_requests, defaults.prompt_len, defaults.output_len) == (200, 256, 128)
    assert _args("--request-rates", "2,inf,0.5").request_rates == [2, math.inf, 0.5]
    for bad in ("0", "fast", ""):
        with pytest.raises(SystemExit):
            _args("--request-rates", bad)


def test_the_workload_is_the_same_at_every_rate_and_within_its_spread():
    args = _args("--num-requests", "300", "--prompt-len", "100", "--output-len", "20", "--len-spread", "0.5")
    requests = bench_serve.workload(args, vocab_size=512)
    assert requests == bench_serve.workload(args, vocab_size=512)
    assert all(50 <= len(p) <= 150 and 10 <= n <= 30 and max(p) < 512 for p, n in requests)
    assert len({len(p) for p, _ in requests}) > 10
    fixed = bench_serve.workload(_args("--prompt-len", "7", "--len-spread", "0"), vocab_size=512)
    assert {len(p) for p, _ in fixed} == {7}


def test_arrivals_are_poisson_at_the_rate():
    times = bench_serve.arrivals(50.0, 5000, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.1)  # exponential: stdev = mean
    assert bench_serve.arrivals(math.inf, 3, seed=1) == [0, 0, 0]


def test_summary_statistics():
    results = [{"ok": True, "ttft": 0.1 * (i + 1), "latency": 1.0 + 0.1 * i, "tokens": 11, "itls": [0.05, 0.15],
                "prompt_tokens": 5} for i in range(10)]
    results.append({"ok": False, "error": "HTTP 503", "prompt_tokens": 5})
    row = bench_serve.summarize(4.0, results, duration_s=2.0)
    assert (row["completed"], row["failed"], row["errors"]) == (10, 1, ["HTTP 503"])
    assert row["request_throughput"] == 5 and row["output_throughput"] == 55 and row["total_token_throughput"] == 80
    assert row["ttft_ms_p50"] == pytest.approx(550) and row["ttft_ms_p99"] == pytest.approx(991)
    assert row["itl_ms_p50"] == pytest.approx(100) and row["tpot_ms_mean"] == pytest.approx(90)
    assert [r["ttft_ms"] for r in row["slowest_ttft"]] == pytest.approx([1000, 900, 800, 700, 600])
    assert bench_serve.summarize(math.inf, [], 1.0)["request_rate"] == "inf"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_without_a_gpu_only_the_tiny_preset_runs(capsys, tmp_path):
    assert bench_serve.run(_args("--out", str(tmp_path))) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out and not list(tmp_path.iterdir())


def test_smoke_run_on_the_tiny_preset_writes_its_results(tmp_path, capsys):
    pytest.importorskip("uvicorn")  # the serve extra
    argv = ["bench", "serve", "--model", "tiny", "--request-rates", "50,inf", "--num-requests", "6",
            "--prompt-len", "12", "--output-len", "5", "--max-num-seqs", "4", "--mode", "eager", "--out", str(tmp_path)]
    assert main(argv) == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    assert [r["request_rate"] for r in result["rows"]] == [50.0, "inf"]
    for row in result["rows"]:
        assert (row["completed"], row["failed"]) == (6, 0)
        assert row["output_throughput"] > 0 and 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"]
        assert row["itl_ms_p50"] is not None and row["e2e_ms_p50"] >= row["ttft_ms_p50"]
    assert result["config"]["served_model"] == "tiny"
    markdown = (tmp_path / "serve.md").read_text()
    assert "TTFT p99 ms" in markdown and "| inf |" in markdown
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "output tok/s" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--num-requests", "0"], ["--prompt-len", "-5"], ["--len-spread", "-0.1"]])
def test_bad_option_values_are_one_line_errors_before_any_work(argv, capsys):
    from fuselab.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["bench", "serve", "--model", "tiny", *argv])
    assert stop.value.code == 2
    assert argv[0] in capsys.readouterr().err
