import argparse

import pytest
import torch

from fuselab.bench import decode as bench_decode
from fuselab.bench import decode_report


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_decode.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_options_parse():
    defaults = _args()
    assert defaults.preset == "llama3-1b" and defaults.batch_sizes == [1] and defaults.prompt_len == 128
    assert defaults.new_tokens == 256 and defaults.modes == list(bench_decode.MODES)
    args = _args("--preset", "llama3-8b", "--batch-sweep", "--modes", "graphs,hf", "--no-hf", "--quick")
    assert args.batch_sizes == [1, 8, 64, 256] and args.modes == ["hf", "graphs"] and args.no_hf and args.quick
    assert _args("--batch-sizes", "8,1").batch_sizes == [1, 8]
    with pytest.raises(SystemExit):
        _args("--modes", "turbo")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_without_a_gpu_it_says_so_and_succeeds(capsys, tmp_path):
    assert bench_decode.run(_args("--out", str(tmp_path))) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_roofline_reads_every_weight_once_per_step():
    # The reference figures: 1.24 B and 8.03 B parameters, ~1713 and ~264 tok/s at 4.23 TB/s, batch 1.
    weights_1b, kv_1b = bench_decode.model_bytes("llama3-1b")
    weights_8b, _ = bench_decode.model_bytes("llama3-8b")
    assert round(weights_1b / 2e9, 2) == 1.24 and round(weights_8b / 2e9, 2) == 8.03
    assert kv_1b == 2 * 16 * 8 * 64 * 2
    assert bench_decode.roofline_tok_s("llama3-1b", 1, 0, 4230.0) == pytest.approx(1713, rel=0.01)
    assert bench_decode.roofline_tok_s("llama3-8b", 1, 0, 4230.0) == pytest.approx(264, rel=0.01)
    # A larger batch reads the weights once for all its rows.
    assert bench_decode.roofline_tok_s("llama3-8b", 64, 256, 4230.0) > 50 * 264


def _result() -> dict:
    rows = [dict(mode=m, batch=b, decode_tok_s=100.0 * (i + 1), ttft_ms=12.0, itl_p50_ms=1.0, itl_p99_ms=2.0,
                 kernels_per_step=200.0 / (i + 1), compile_s=None if m != "graphs" else 1.5, roofline_tok_s=1700.0 * b,
                 bandwidth_pct=100 * 100.0 * (i + 1) / (1700.0 * b))
            for i, m in enumerate(bench_decode.MODES) for b in (1, 8)]
    rows[2]["logits_vs_hf"] = {"max_rel_diff": 3e-3, "argmax_agreement": 0.995}
    parts = {p: {"us": 10.0, "share": 0.2} for p in decode_report.BREAKDOWN}
    doctor = {"graphs": dict(verdict="memory-bound", wall_us_per_step=700.0, kernels_per_step=180, syncs_per_step=0,
                             gpu_busy_pct=95.0, breakdown=parts, first_fix=None)}
    return {"header": {"date": "2026-12-01T00:00:00+00:00", "command": "fuselab bench decode",
                       "device": dict(name="GPU", torch="2.11", triton="3.6", cuda="13.0", python="3.12")},
            "config": dict(preset="llama3-1b", prompt_len=128, new_tokens=256, batch_sizes=[1, 8],
                           modes=list(bench_decode.MODES), weight_bytes=2.47e9, mean_context=256,
                           copy_bandwidth_gbs=4230.0, ceilings_source="stated", doctor_batch=1),
            "rows": rows, "doctor": doctor}


def test_markdown_plot_and_table_render(tmp_path, capsys):
    result = _result()
    bench_decode.write_markdown(result, tmp_path / "decode.md")
    text = (tmp_path / "decode.md").read_text()
    assert "| graphs | 8 | 600.0 | 4% |" in text and "same top token at 99.5% of positions" in text and "memory-bound" in text and "`fuselab bench decode`" in text
    bench_decode.write_plot(result, tmp_path / "decode.png")
    assert (tmp_path / "decode.png").stat().st_size > 0
    bench_decode.print_table(result)
    assert "bandwidth achieved" in capsys.readouterr().out


def test_a_failing_mode_costs_its_own_rows_only(monkeypatch, tmp_path, capsys):
    def hf_fails(mode, args, rows, doctor):
        rows.append(dict(mode=mode, batch=1, decode_tok_s=50.0, ttft_ms=1.0, itl_p50_ms=1.0, itl_p99_ms=1.0,
                         kernels_per_step=600.0, compile_s=None))
        raise RuntimeError("the compiler broke\nwith a long traceback")

    def engine(mode, args, rows, doctor):
        for batch in args.batch_sizes:
            rows.append(dict(mode=mode, batch=batch, decode_tok_s=900.0, ttft_ms=1.0, itl_p50_ms=1.0,
                             itl_p99_ms=1.0, kernels_per_step=180.0, compile_s=0.1))

    monkeypatch.setattr(bench_decode, "_measure_hf_mode", hf_fails)
    monkeypatch.setattr(bench_decode, "_measure_engine_mode", engine)
    result = bench_decode.measure(_args("--modes", "hf,hf-compile,graphs", "--batch-sizes", "1,8", "--quick"))
    assert result["failed"] == {"hf": "RuntimeError: the compiler broke", "hf-compile": "RuntimeError: the compiler broke"}
    assert [(r["mode"], r["batch"]) for r in result["rows"]] == [("hf", 1), ("hf-compile", 1), ("graphs", 1), ("graphs", 8)]
    assert "going on with the other modes" in capsys.readouterr().out
    bench_decode.write_markdown(result, tmp_path / "decode.md")
    assert "- hf failed" in (tmp_path / "decode.md").read_text()
    bench_decode.write_plot(result, tmp_path / "decode.png")  # hf has no batch-8 row
    bench_decode.print_table(result)
    assert "hf-compile failed" in capsys.readouterr().out


def test_hf_compile_uses_transformers_own_compile_path(monkeypatch):
    """Compiling model.forward on top of generate's own static-cache compile nests two CUDA-graph
    trees whose outputs overwrite each other (it crashed on the H200): the harness must only ask
    transformers for its path."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64)
    model = transformers.LlamaForCausalLM(config)
    forward = model.forward
    seen = []
    monkeypatch.setattr(bench_decode, "build_hf", lambda preset: model)
    monkeypatch.setattr(bench_decode, "measure_hf", lambda mode, m, batch, args: seen.append(m) or
                        dict(mode=mode, batch=batch, decode_tok_s=1.0))
    rows = []
    bench_decode._measure_hf_mode("hf-compile", _args("--quick"), rows, {})
    assert seen == [model] and model.forward == forward
    assert model.generation_config.cache_implementation == "static"
    assert model.generation_config.compile_config.mode == "reduce-overhead"


def test_hf_patch_compares_the_patched_logits_with_the_model_before():
    from engine_checkpoints import build_hf_model

    model = build_hf_model("llama3")
    got = bench_decode.patch_and_compare(model, 12)
    assert any(type(m).__name__ == "FusedRMSNorm" for m in model.modules())
    assert got["argmax_agreement"] == 1.0 and 0 < got["max_rel_diff"] < 1e-4
