import argparse

import pytest
import torch

from fuselab.bench import decode as bench_decode
from fuselab.bench import decode_hf, decode_rounds
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
    monkeypatch.setattr(decode_hf, "build_hf", lambda preset: model)
    monkeypatch.setattr(bench_decode, "hf_contender", lambda mode, m, args, extra: seen.append(m))
    monkeypatch.setattr(bench_decode, "measure_contenders", lambda contenders, args, rows, doctor: None)
    rows = []
    bench_decode._measure_hf_mode("hf-compile", _args("--quick"), rows, {})
    assert seen == [model] and model.forward == forward
    assert model.generation_config.cache_implementation == "static"
    assert model.generation_config.compile_config.mode == "reduce-overhead"


def test_hf_patch_compares_the_patched_logits_with_the_model_before():
    from engine_checkpoints import build_hf_model

    model = build_hf_model("llama3")
    patched, got = decode_hf.patched_copy(model, torch.tensor(bench_decode._prompts(1, 12, model.config.vocab_size)))
    assert any(type(m).__name__ == "FusedRMSNorm" for m in patched.modules())
    assert not any(type(m).__name__ == "FusedRMSNorm" for m in model.modules())  # a copy was patched
    assert got["argmax_agreement"] == 1.0 and 0 < got["max_rel_diff"] < 1e-4


def test_options_take_the_number_of_rounds():
    assert _args().rounds == 3 and _args("--rounds", "5").rounds == 5
    with pytest.raises(SystemExit):
        _args("--rounds", "0")


def _scripted(label: str, full_s: list[float], calls: list) -> decode_rounds.Contender:
    """A contender whose 1-token generate takes 0.1 s and whose full ones take full_s in turn (the
    first for the warm-up), noting each call."""
    times = iter(full_s)

    def timer(batch):
        def generate_s(new_tokens):
            calls.append((label, new_tokens))
            return 0.1 if new_tokens == 1 else next(times)
        return generate_s

    return decode_rounds.Contender(label, label, timer, lambda batch, first_s: {"ttft_ms": 1.0})


def test_contenders_take_turns_and_the_ratio_is_the_median_of_per_round_ratios(capsys):
    calls = []
    # batch 1, 11 new tokens: 10 tokens decoded in full_s - 0.1 s. hf: 10, 5, 10 tok/s; hf-patch: 20, 10, 10.
    hf = _scripted("hf", [9.0, 1.1, 2.1, 1.1], calls)
    patched = _scripted("hf-patch", [9.0, 0.6, 1.1, 1.1], calls)
    rows = []
    decode_rounds.measure_contenders([hf, patched], _args("--new-tokens", "11", "--rounds", "3", "--quick"), rows, {})
    warm_up = [("hf", 11), ("hf-patch", 11)]
    assert calls == warm_up + [("hf", 1), ("hf", 11), ("hf-patch", 1), ("hf-patch", 11)] * 3
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["hf"]["round_tok_s"] == pytest.approx([10, 5, 10])
    assert by_mode["hf-patch"]["round_tok_s"] == pytest.approx([20, 10, 10])
    assert by_mode["hf"]["decode_tok_s"] == pytest.approx(10) and by_mode["hf-patch"]["decode_tok_s"] == pytest.approx(10)
    # Per round 2x, 2x, 1x: the median of those, not the ratio of the medians (1x).
    assert by_mode["hf-patch"]["vs_hf"] == pytest.approx(2) and by_mode["hf-patch"]["vs_hf_rounds"] == pytest.approx([2, 2, 1])
    assert (by_mode["hf-patch"]["vs_hf_min"], by_mode["hf-patch"]["vs_hf_max"]) == pytest.approx((1, 2))
    assert (by_mode["hf"]["decode_tok_s_min"], by_mode["hf"]["decode_tok_s_max"]) == pytest.approx((5, 10))
    assert "vs_hf" not in by_mode["hf"]
    assert by_mode["hf"]["first_generate_tok_s"] == pytest.approx(10 / 8.9)
    assert "round 3/3" in capsys.readouterr().out


def test_a_contender_that_fails_in_the_rounds_leaves_the_others_measured():
    calls = []
    hf = _scripted("hf", [2.1] * 4, calls)
    broken = _scripted("fused", [2.1], calls)  # its second full generate finds no time left
    failed, rows = {}, []
    decode_rounds.measure_contenders([hf, broken], _args("--new-tokens", "11", "--quick"), rows, {}, failed)
    assert [r["mode"] for r in rows] == ["hf"] and list(failed) == ["fused"]
    assert calls.count(("hf", 11)) == 4


def test_rows_measured_apart_from_hf_get_the_ratio_of_medians():
    rows = [dict(mode="hf", batch=1, decode_tok_s=50.0), dict(mode="graphs", batch=1, decode_tok_s=1000.0),
            dict(mode="graphs", batch=8, decode_tok_s=8000.0), dict(mode="hf-patch", batch=1, decode_tok_s=60.0, vs_hf=1.3)]
    bench_decode._ratios_of_medians(rows)
    assert rows[1]["vs_hf"] == 20.0 and "vs_hf" not in rows[2] and rows[3]["vs_hf"] == 1.3


def test_only_hf_patch_and_fused_beside_hf_take_turns():
    assert bench_decode.interleaved_modes(["hf", "hf-patch", "hf-compile", "fused", "graphs"], 1) == ["hf", "hf-patch", "fused"]
    assert bench_decode.interleaved_modes(["hf", "fused"], 2) == []  # the engine on other GPUs
    assert bench_decode.interleaved_modes(["hf"], 1) == [] and bench_decode.interleaved_modes(["fused", "graphs"], 1) == []


def _tiny_hf():
    from engine_checkpoints import build_hf_model

    model = build_hf_model("llama3")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def test_the_rate_is_timed_on_a_plain_generate_and_latencies_on_a_streamed_one(monkeypatch):
    model = _tiny_hf()
    seen = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda ids, **kw: seen.append(kw) or generate(ids, **kw))
    contender = bench_decode.hf_contender("hf", model, _args("--prompt-len", "6", "--new-tokens", "4"))
    assert contender.timer(2)(4) > 0
    assert "streamer" not in seen[-1] and "min_new_tokens" not in seen[-1]
    assert seen[-1]["max_new_tokens"] == 4 and seen[-1]["do_sample"] is False
    ttft, itls = decode_hf.streamed_latencies(model, torch.tensor(bench_decode._prompts(1, 6, 256)), 4)
    assert isinstance(seen[-1]["streamer"], decode_hf.TokenClock) and ttft > 0 and len(itls) == 3


def test_hf_and_its_patched_copy_are_measured_in_turns_on_one_model(monkeypatch):
    model = _tiny_hf()
    turns = []
    generate_s = decode_hf.generate_s
    monkeypatch.setattr(decode_hf, "build_hf", lambda preset: model)
    monkeypatch.setattr(decode_hf, "generate_s", lambda m, ids, n: turns.append((m is model, n)) or generate_s(m, ids, n))
    monkeypatch.setattr(decode_hf, "kernels_per_step", lambda m, ids, n, compiled: 100.0)
    rows, failed = [], {}
    args = _args("--modes", "hf,hf-patch", "--prompt-len", "6", "--new-tokens", "6", "--rounds", "2", "--quick")
    bench_decode._measure_interleaved(["hf", "hf-patch"], args, rows, {}, failed)
    assert not failed and [r["mode"] for r in rows] == ["hf", "hf-patch"]
    assert turns == [(True, 6), (False, 6)] + [(True, 1), (True, 6), (False, 1), (False, 6)] * 2
    hf, patched = rows
    assert len(hf["round_tok_s"]) == len(patched["round_tok_s"]) == 2
    assert patched.get("vs_hf_rounds", []) == [a / b for a, b in zip(patched["round_tok_s"], hf["round_tok_s"]) if a and b]
    assert patched["logits_vs_hf"]["argmax_agreement"] == 1.0
    assert not any(type(m).__name__ == "FusedRMSNorm" for m in model.modules())
    assert hf["ttft_ms"] > 0 and hf["kernels_per_step"] == 100.0


def test_the_report_shows_the_rounds_range_and_the_ratio_to_hf(tmp_path):
    result = _result()
    result["config"].update(rounds=3, interleaved=["hf", "hf-patch", "fused"])
    patched = next(r for r in result["rows"] if r["mode"] == "hf-patch" and r["batch"] == 1)
    patched.update(decode_tok_s_min=180.0, decode_tok_s_max=205.5, vs_hf=1.3, vs_hf_min=1.2, vs_hf_max=1.4,
                   vs_hf_rounds=[1.2, 1.3, 1.4], first_generate_tok_s=40.0)
    graphs = next(r for r in result["rows"] if r["mode"] == "graphs" and r["batch"] == 1)
    graphs["vs_hf"] = 6.0
    bench_decode.write_markdown(result, tmp_path / "decode.md")
    text = (tmp_path / "decode.md").read_text()
    assert "| hf-patch | 1 | 200.0 | 12% | 180.0-205.5 | 1.30x (1.20-1.40) | 40.0 |" in text
    assert "| graphs | 1 | 600.0 | 35% | — | 6.00x* | — |" in text
    assert "median of 3 rounds" in text and "in turns with hf (hf, hf-patch, fused)" in text
    bench_decode.write_plot(result, tmp_path / "decode.png")


def test_hf_alone_is_measured_in_rounds_and_written(monkeypatch, tmp_path):
    model = _tiny_hf()
    monkeypatch.setattr(decode_hf, "build_hf", lambda preset: model)
    monkeypatch.setattr(decode_hf, "kernels_per_step", lambda m, ids, n, compiled: 100.0)
    result = bench_decode.measure(_args("--modes", "hf", "--prompt-len", "6", "--rounds", "2", "--quick"))
    assert not result["failed"] and result["config"]["interleaved"] == [] and result["config"]["rounds"] == 2
    (row,) = result["rows"]
    assert row["mode"] == "hf" and len(row["round_tok_s"]) == 2 and "vs_hf" not in row
    bench_decode.write_json(result, tmp_path, "decode")
    bench_decode.write_markdown(result, tmp_path / "decode.md")
    assert "| hf | 1 |" in (tmp_path / "decode.md").read_text()


def test_the_engine_takes_its_turn_beside_hf(monkeypatch):
    from fuselab.engine import LLM

    model, llm = _tiny_hf(), LLM("tiny", mode="eager", max_model_len=64)
    monkeypatch.setattr(decode_hf, "build_hf", lambda preset: model)
    monkeypatch.setattr(decode_hf, "kernels_per_step", lambda m, ids, n, compiled: 100.0)
    monkeypatch.setattr(bench_decode, "_engine", lambda mode, args: (llm, {"quantization": "bf16", "weights_gb": None}))
    monkeypatch.setattr(bench_decode, "count_launches", lambda step: step() or {"kernels": 7})
    turns = []
    generate = llm.generate
    monkeypatch.setattr(llm, "generate", lambda prompts, params: turns.append(params.max_tokens) or generate(prompts, params))
    rows, failed = [], {}
    args = _args("--modes", "hf,fused", "--prompt-len", "6", "--new-tokens", "5", "--rounds", "2", "--quick")
    bench_decode._measure_interleaved(["hf", "fused"], args, rows, {}, failed)
    assert not failed and [r["mode"] for r in rows] == ["hf", "fused"]
    assert turns[:5] == [5, 1, 5, 1, 5]  # warm-up, then a 1-token and a full generate a round
    fused = rows[1]
    assert len(fused["round_tok_s"]) == 2 and fused["kernels_per_step"] == 7 and fused["ttft_ms"] > 0
    assert fused.get("vs_hf_rounds", []) == [a / b for a, b in zip(fused["round_tok_s"], rows[0]["round_tok_s"]) if a and b]
