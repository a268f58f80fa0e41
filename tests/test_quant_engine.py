"""LLM(..., quantization=...): quantize-at-load from float checkpoints and random presets, tied and
untied heads, eager against fused, the quality metrics, the CLI and the bench's quantized rows."""

from __future__ import annotations

import argparse
import importlib
import warnings

import pytest
import torch

from engine_checkpoints import build_hf_model, save_checkpoint
from fuselab.bench import decode as bench_decode
from fuselab.bench import decode_report
from fuselab.bench import decode_quant
from fuselab.cli import main
from fuselab.engine import LLM, SamplingParams
from fuselab.engine import cli as engine_cli
from fuselab.engine.engine_config import EngineConfig
from fuselab.engine.quant_quality import compare, log_probs
from fuselab.engine.quantize import (
    QUANTIZATION_CHOICES, SPLIT_COUNTERS, QuantizedLinear, parse_quantization, weight_bytes)
from fuselab.kernels import quantize_weight


GREEDY = SamplingParams(temperature=0, max_tokens=10)
PROMPTS = [[3, 4, 5, 6], [200] * 25]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Untied (Llama 3) and tied (Llama 2 style) float checkpoints, and their float tensors."""
    root = tmp_path_factory.mktemp("quant")
    return {arch: (model := build_hf_model(arch), save_checkpoint(model, root / arch)) for arch in ("llama3", "llama2-tied")}


def test_quantization_names_resolve_to_schemes():
    assert parse_quantization(None) is None
    assert [(s.fmt, s.group_size) for s in map(parse_quantization, QUANTIZATION_CHOICES)] == [
        ("int4", 128), ("int4", 32), ("int4", 64), ("int4", 128), ("int8", 0), ("fp8", 0)]
    assert parse_quantization("int4-g64").name == "int4-g64"
    assert engine_cli.QUANTIZATION_CHOICES == QUANTIZATION_CHOICES  # spelled twice so that --help stays quick
    with pytest.raises(ValueError, match=r"quantization must be one of \('int4', 'int4-g32'"):
        EngineConfig("tiny", mode="eager", quantization="int3")
    assert EngineConfig("tiny", mode="eager", quantization="fp8").quantization.fmt == "fp8"


@pytest.mark.parametrize("quantization", ["int4-g32", "int8", "fp8"])
def test_each_projection_holds_the_quantization_of_its_float_weights(checkpoints, quantization):
    hf_model, path = checkpoints["llama3"]
    llm = LLM(path, mode="eager", dtype="float32", max_model_len=64, quantization=quantization)
    scheme = llm.engine_config.quantization
    hf = hf_model.model.layers[1]
    merged = {"self_attn.qkv_proj": [hf.self_attn.q_proj, hf.self_attn.k_proj, hf.self_attn.v_proj],
              "mlp.gate_up_proj": [hf.mlp.gate_proj, hf.mlp.up_proj], "mlp.down_proj": [hf.mlp.down_proj]}
    for name, parts in merged.items():
        layer = llm.model.model.layers[1].get_submodule(name)
        # Quantized where the engine quantized it (a GPU's division rounds as the CPU's, but the
        # comparison needs both on one device).
        expected = quantize_weight(torch.cat([p.weight.detach() for p in parts]).to(layer.qweight.device), scheme.fmt,
                                   scheme.group_size or 128)
        assert isinstance(layer, QuantizedLinear)
        assert torch.equal(layer.qweight, expected.data) and torch.equal(layer.scales, expected.scales), name
    head = quantize_weight(hf_model.lm_head.weight.detach().to(llm.device), scheme.fmt, scheme.group_size or 128)
    assert torch.equal(llm.model.lm_head.qweight, head.data)
    assert llm.model.model.embed_tokens.weight.dtype == torch.float32  # lookups stay float


def test_a_tied_head_is_a_quantized_copy_of_the_float_embedding(checkpoints):
    hf_model, path = checkpoints["llama2-tied"]
    llm = LLM(path, mode="eager", dtype="float32", max_model_len=64, quantization="int8")
    assert llm.model.head_copies_embedding
    embedding = hf_model.model.embed_tokens.weight.detach().to(llm.device)
    assert torch.equal(llm.model.model.embed_tokens.weight, embedding)
    assert torch.equal(llm.model.lm_head.qweight, quantize_weight(embedding, "int8").data)


@pytest.mark.parametrize("arch", ["llama3", "llama2-tied"])
@pytest.mark.parametrize("quantization", ["int4", "int8", "fp8"])
def test_fused_kernels_give_the_tokens_of_the_eager_reference(checkpoints, arch, quantization):
    path = checkpoints[arch][1]
    eager = LLM(path, mode="eager", dtype="float32", max_model_len=64, quantization=quantization)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fused on the CPU: the interpreter warning
        fused = LLM(path, mode="fused", dtype="float32", max_model_len=64, quantization=quantization)
    assert [o.token_ids for o in fused.generate(PROMPTS, GREEDY)] == [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("quantization, threshold, launcher", [
    ("fp8", "W8A8_ONE_ROW_MIN_WEIGHTS", "launch_w8a8"),
    ("int8", "A8_MIN_WEIGHTS", "launch_gemv_a8"), ("int4", "A8_MIN_WEIGHTS", "launch_gemv_a8"),
])
def test_one_row_with_x_rounded_gives_the_eager_tokens(checkpoints, monkeypatch, quantization, threshold, launcher):
    # Every weight counted as large: decode's one-row products round x (fp8's W8A8, int8 and int4 on the
    # int8-dot GEMV), in the kernels and in the eager reference alike (the tiny model's weights are far below
    # the real thresholds).
    ql = importlib.import_module("fuselab.kernels.quantized_linear")
    monkeypatch.setattr(ql, threshold, 1)
    taken = []
    launch = getattr(ql, launcher)
    monkeypatch.setattr(ql, launcher, lambda x2, *a, **kw: taken.append(x2.shape[0]) or launch(x2, *a, **kw))
    path = checkpoints["llama3"][1]
    eager = LLM(path, mode="eager", dtype="float32", max_model_len=64, quantization=quantization)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fused on the CPU: the interpreter warning
        fused = LLM(path, mode="fused", dtype="float32", max_model_len=64, quantization=quantization)
    prompt = [PROMPTS[0]]
    expected = [o.token_ids for o in eager.generate(prompt, GREEDY)]
    assert [o.token_ids for o in fused.generate(prompt, GREEDY)] == expected
    assert 1 in taken  # a decode step's one row went through it


def test_each_layer_carries_split_k_counters_that_stay_at_zero(checkpoints):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fused on the CPU: the interpreter warning
        llm = LLM(checkpoints["llama3"][1], mode="fused", dtype="float32", max_model_len=64, quantization="int8")
    layers = [m for m in llm.model.modules() if isinstance(m, QuantizedLinear)]
    llm.generate(PROMPTS, GREEDY)
    for layer in layers:
        counters = layer.weight.counters
        assert counters.dtype == torch.int32 and counters.numel() == SPLIT_COUNTERS
        assert counters.device == layer.qweight.device and not counters.any()
    assert len({id(layer.weight.counters) for layer in layers}) == len(layers)  # a layer's own


def test_a_random_preset_quantizes_the_weights_its_float_model_draws():
    float_llm = LLM("tiny", mode="eager", max_model_len=64)
    llm = LLM("tiny", mode="eager", max_model_len=64, quantization="int4")
    float_layer, layer = float_llm.model.model.layers[1], llm.model.model.layers[1]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        expected = quantize_weight(float_layer.get_submodule(name).weight.detach(), "int4")
        assert torch.equal(layer.get_submodule(name).qweight, expected.data), name
    assert torch.equal(llm.model.model.norm.weight, float_llm.model.model.norm.weight)
    assert weight_bytes(llm.model) < weight_bytes(float_llm.model)


# Bounds at about 1.5x what these tiny random models give: next-token entropy ~4.9 nats of ln(256)
# = 5.5, so nearly flat distributions whose argmax flips easily (a trained model's agree far more).
# int8 and fp8 score the sequence's 64 rows as W8A8: int8 KL 6.5e-4, 97.5% (weight-only 3.3e-4, 100%),
# fp8 KL 0.008, 95% (weight-only 0.005, 97.5%).
@pytest.mark.parametrize("quantization, max_kl, min_top1", [("int8", 1e-3, 0.95), ("fp8", 1.2e-2, 0.9),
                                                             ("int4", 0.11, 0.3), ("int4-g32", 0.09, 0.3)])
def test_quantized_logits_stay_close_to_the_float_models(checkpoints, quantization, max_kl, min_top1):
    path = checkpoints["llama3"][1]
    reference = LLM(path, mode="eager", dtype="float32", max_model_len=128)
    prompt = PROMPTS[1]
    decoded = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].token_ids
    sequence = prompt + decoded[:-1]
    expected = log_probs(reference.model, sequence)
    assert compare(expected, expected) == {"mean_kl": 0.0, "top1_agreement": 1.0, "positions": len(sequence)}
    llm = LLM(path, mode="eager", dtype="float32", max_model_len=128, quantization=quantization)
    got = compare(expected, log_probs(llm.model, sequence), first=len(prompt) - 1)
    assert got["positions"] == 40 and got["mean_kl"] <= max_kl and got["top1_agreement"] >= min_top1, got


def test_generate_takes_quantization(capsys):
    argv = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3", "--max-tokens", "3", "--mode", "eager",
            "--quantization", "int4-g64"]
    assert main(argv) == 0
    assert "3 tokens, finish: length" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", "tiny", "--prompt", "x", "--quantization", "int2"])


# --------------------------------------------------------------------------------------------
# fuselab bench decode --quantization
# --------------------------------------------------------------------------------------------


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_decode.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_takes_a_list_of_formats():
    assert _bench_args().quantization == []
    assert _bench_args("--quantization", "int4,int8,int4").quantization == ["int4", "int8"]
    with pytest.raises(SystemExit):
        _bench_args("--quantization", "int4,nf4")


def test_quantized_rows_sit_beside_bf16_with_their_own_roofline(monkeypatch, tmp_path, capsys):
    def engine(mode, args, rows, doctor, quantization=None):
        extra = {"quantization": quantization or "bf16", "weights_gb": 16.0 if quantization is None else 4.5}
        if quantization is not None:
            extra["step_weight_bytes"] = int(4.3e9)
        for batch in args.batch_sizes:
            rows.append(dict(mode=mode, batch=batch, decode_tok_s=240.0 if quantization is None else 720.0,
                             ttft_ms=1.0, itl_p50_ms=1.0, itl_p99_ms=1.0, kernels_per_step=180.0, compile_s=0.1, **extra))

    monkeypatch.setattr(bench_decode, "_measure_engine_mode", engine)
    monkeypatch.setattr(decode_quant, "quality", lambda preset, formats, prompt_len, new_tokens: {
        f: {"mean_kl": 0.01, "top1_agreement": 0.97, "positions": new_tokens} for f in formats})
    args = _bench_args("--preset", "llama3-8b", "--modes", "eager,graphs", "--quantization", "int4,int8", "--quick")
    result = bench_decode.measure(args)
    labels = [(decode_report._label(r), r["batch"]) for r in result["rows"]]
    assert labels == [("eager", 1), ("graphs", 1), ("graphs int4", 1), ("graphs int8", 1)]  # eager takes no format
    bf16, int4 = result["rows"][1], result["rows"][2]
    assert int4["roofline_tok_s"] > 3 * bf16["roofline_tok_s"]
    assert set(result["quality"]) == {"int4", "int8"}
    bench_decode.write_markdown(result, tmp_path / "decode.md")
    text = (tmp_path / "decode.md").read_text()
    assert "| graphs int4 | 1 | 720.0 |" in text and "| 4.50 | 3.00x |" in text
    assert "| int4 | 0.0100 | 97.0% | 32 |" in text
    bench_decode.write_plot(result, tmp_path / "decode.png")
    bench_decode.print_table(result)
    assert "top-1 agreement" in capsys.readouterr().out


def test_step_bytes_count_each_projection_packed():
    llm = LLM("tiny", mode="eager", max_model_len=64, quantization="int8")
    c = llm.config
    layers = [m for m in llm.model.modules() if isinstance(m, QuantizedLinear)]
    dense = sum(2 * m.in_features * m.out_features for m in layers)
    assert len(layers) == 4 * c.num_layers + 1  # and the tied head's copy
    packed = decode_quant.step_bytes(llm.model, dense)
    assert packed == sum(m.qweight.nbytes + m.scales.nbytes for m in layers)
    assert packed < dense / 1.9


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["int4", "int4-g32", "int4-g64", "int8", "fp8"])
def test_graphs_mode_replays_the_quantized_step_of_fused_mode(checkpoints, quantization):
    """Batches of 1, 3, 12 and 20 sequences: the GEMV, the tensor-core kernel and (prefill) dequantize +
    cuBLAS (int8 and fp8: W8A8 from 9 rows; 12 replays the graph of 16), the decode step replayed from CUDA
    graphs, against the same model without graphs."""
    path = checkpoints["llama3"][1]
    prompts = [[(7 * i + j) % 256 for j in range(5 + i)] for i in range(20)]
    args = dict(dtype="float32", max_model_len=128, device="cuda", quantization=quantization, max_num_seqs=32)
    fused = LLM(path, mode="fused", **args)
    graphs = LLM(path, mode="graphs", **args)
    for batch in (prompts[:1], prompts[:3], prompts[:12], prompts):
        expected = [o.token_ids for o in fused.generate(batch, GREEDY)]
        assert [o.token_ids for o in graphs.generate(batch, GREEDY)] == expected
    assert graphs.runner.graphs.replays > 0
