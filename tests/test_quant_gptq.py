"""GPTQ checkpoints: tiny ones written here in the exact layout AutoGPTQ / GPTQModel / transformers
save (4-bit, sym, desc_act false), loaded by the engine and checked against the weights they
stand for and against transformers on those weights.

The layout, from AutoGPTQ's QuantLinear.pack (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py)
and the dequantization its torch fallback runs: for a projection with weight W [N, K],
    qweight int32 [K/8, N]   bits 4j of qweight[i, n] = code of W[n, 8i + j]
    qzeros  int32 [G, N/8]   bits 4j of qzeros[g, i]  = zero point of output 8i + j, group g, minus 1
    scales  fp16  [G, N]     g_idx int32 [K] = k // group_size
    W[n, k] = scales[g, n] · (code - zero), g = g_idx[k]; symmetric: zero = 8, scale = 2·amax/15.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_checkpoints import build_hf_model, hf_greedy, save_checkpoint
from fuselab.engine import LLM, SamplingParams
from fuselab.engine.config import CheckpointError
from fuselab.kernels.reference_quant import dequantize


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gptq_quantize(weight: torch.Tensor, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes [K, N] uint32, scales [G, N] float16) of GPTQ's symmetric round-to-nearest grid."""
    w = weight.double().t().numpy()  # [K, N], as GPTQ stores it
    k, n = w.shape
    groups = -(-k // group)
    scales = np.zeros((groups, n), dtype=np.float16)
    codes = np.zeros((k, n), dtype=np.uint32)
    for g in range(groups):
        rows = slice(g * group, min(k, (g + 1) * group))
        amax = np.abs(w[rows]).max(axis=0)
        scales[g] = np.where(amax > 0, 2 * amax / 15, 1.0).astype(np.float16)
        codes[rows] = np.clip(np.round(w[rows] / scales[g].astype(np.float64)) + 8, 0, 15).astype(np.uint32)
    return codes, scales


def gptq_pack(codes: np.ndarray, scales: np.ndarray, group: int, zero_offset: int = 1) -> dict[str, torch.Tensor]:
    """The four tensors of one projection, packed word by word as the layout above says."""
    k, n = codes.shape
    qweight = np.zeros((k // 8, n), dtype=np.uint32)
    for i in range(k // 8):
        for j in range(8):
            qweight[i] |= codes[8 * i + j] << np.uint32(4 * j)
    zeros = np.full((scales.shape[0], n), 8 - zero_offset, dtype=np.uint32)
    qzeros = np.zeros((scales.shape[0], n // 8), dtype=np.uint32)
    for i in range(n // 8):
        for j in range(8):
            qzeros[:, i] |= zeros[:, 8 * i + j] << np.uint32(4 * j)
    return {"qweight": torch.from_numpy(qweight.view(np.int32)), "qzeros": torch.from_numpy(qzeros.view(np.int32)),
            "scales": torch.from_numpy(scales), "g_idx": torch.arange(k, dtype=torch.int32) // group}


def gptq_dequantize(codes: np.ndarray, scales: np.ndarray, group: int) -> torch.Tensor:
    """W [N, K] = scales · (code - 8), from the codes before packing."""
    g_idx = np.arange(codes.shape[0]) // group
    return torch.from_numpy((scales.astype(np.float64)[g_idx] * (codes.astype(np.float64) - 8)).T)


def write_gptq_checkpoint(hf_model, path, group: int, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """Save `hf_model` as a GPTQ checkpoint (every decoder projection quantized, embeddings and
    lm_head float16 as GPTQ leaves them); returns each projection's dequantized weight by name."""
    save_checkpoint(hf_model, path)
    tensors = load_file(path / "model.safetensors")
    out, dequantized = {}, {}
    for name, t in tensors.items():
        prefix = name.removesuffix(".weight")
        if prefix.rsplit(".", 1)[-1] in PROJECTIONS and name.endswith(".weight"):
            codes, scales = gptq_quantize(t, group)
            packed = gptq_pack(codes, scales, group, zero_offset=1 if checkpoint_format == "gptq" else 0)
            out.update({f"{prefix}.{part}": v for part, v in packed.items()})
            dequantized[prefix] = gptq_dequantize(codes, scales, group)
        else:
            out[name] = t.half()
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                     "sym": True, "damp_percent": 0.01, "true_sequential": True,
                                     "checkpoint_format": checkpoint_format}
    config["dtype"] = "float16"
    (path / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.fixture(scope="module", params=[128, 32])
def gptq_checkpoint(request, tmp_path_factory):
    hf_model = build_hf_model("llama3")
    path = tmp_path_factory.mktemp(f"gptq{request.param}") / "ckpt"
    dequantized = write_gptq_checkpoint(hf_model, path, request.param)
    # transformers on the weights the checkpoint stands for (float32, float16 embeddings and norms).
    state = {name: t.float() for name, t in load_file(path / "model.safetensors").items()
             if not name.endswith(("qweight", "qzeros", "scales", "g_idx"))}
    state.update({f"{prefix}.weight": w.float() for prefix, w in dequantized.items()})
    hf_model.load_state_dict(state)
    return path, dequantized, hf_model


def test_the_layout_written_here_dequantizes_to_the_weights_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(48, 256) * 0.05
    codes, scales = gptq_quantize(w, 128)
    packed = gptq_pack(codes, scales, 128)
    assert packed["qweight"].shape == (32, 48) and packed["qzeros"].shape == (2, 6) and packed["scales"].shape == (2, 48)
    assert (packed["qzeros"] == 0x77777777).all()  # zero point 8, stored minus one
    step = torch.from_numpy(scales.astype(np.float64)).repeat_interleave(128, dim=0).t()
    # Half a step, plus what rounding the scale to float16 (2^-11) moves the group's largest weight.
    assert ((gptq_dequantize(codes, scales, 128) - w.double()).abs() <= (0.5 + 7.5 * 2**-11) * step).all()


def test_the_engine_reads_the_codes_the_checkpoint_holds(gptq_checkpoint):
    path, dequantized, _ = gptq_checkpoint
    llm = LLM(path, mode="eager", dtype="float32", max_model_len=64)
    assert llm.engine_config.quantization.name.startswith("gptq-int4")
    layer = llm.model.model.layers[1]
    c = llm.config
    merged = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"], "self_attn.o_proj": ["o_proj"],
              "mlp.gate_up_proj": ["gate_proj", "up_proj"], "mlp.down_proj": ["down_proj"]}
    for module, parts in merged.items():
        got = dequantize(layer.get_submodule(module).weight).cpu()  # the engine's device: cuda where there is one
        expected = torch.cat([dequantized[f"model.layers.1.{module.split('.')[0]}.{p}"] for p in parts])
        assert torch.equal(got, expected), module
    assert llm.model.lm_head.weight.dtype == torch.float32 and c.quantization.zero_offset == 1


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_greedy_tokens_match_transformers_on_the_dequantized_weights(gptq_checkpoint, mode):
    path, _, hf_model = gptq_checkpoint
    prompts = [[5, 6, 7], [100] * 20]
    expected = [hf_greedy(hf_model, p, 8) for p in prompts]
    llm = LLM(path, mode=mode, dtype="float32", max_model_len=64)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))] == expected


@pytest.mark.gpu
def test_graphs_mode_replays_the_fused_step_of_a_gptq_checkpoint(gptq_checkpoint):
    path, _, _ = gptq_checkpoint
    prompts = [[(7 * i + j) % 256 for j in range(3 + i)] for i in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    args = dict(dtype="float32", max_model_len=64, device="cuda", max_num_seqs=8)
    expected = [o.token_ids for o in LLM(path, mode="fused", **args).generate(prompts, greedy)]
    graphs = LLM(path, mode="graphs", **args)
    assert [o.token_ids for o in graphs.generate(prompts, greedy)] == expected
    assert graphs.runner.graphs.replays > 0


def test_gptq_v2_zero_points_are_stored_as_they_are(tmp_path):
    dequantized = write_gptq_checkpoint(build_hf_model("qwen2"), tmp_path, 32, checkpoint_format="gptq_v2")
    llm = LLM(tmp_path, mode="eager", dtype="float32", max_model_len=64)
    got = dequantize(llm.model.model.layers[0].mlp.down_proj.weight).cpu()
    assert torch.equal(got, dequantized["model.layers.0.mlp.down_proj"])
    assert llm.model.model.layers[0].self_attn.qkv_proj.bias is not None  # Qwen2's bias, float16 in the file


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_asymmetric_act_order_and_incomplete_projections_are_refused(tmp_path):
    write_gptq_checkpoint(build_hf_model("llama3"), tmp_path, 32)
    name = "model.layers.0.mlp.up_proj"
    original = load_file(tmp_path / "model.safetensors")

    def asymmetric(t):
        t[f"{name}.qzeros"] = t[f"{name}.qzeros"] + 1  # zero points 9 in the first nibble

    _rewrite(tmp_path, asymmetric)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}.qzeros': zero points other than 8"):
        LLM(tmp_path, mode="eager", max_model_len=64)

    def act_order(t):
        t.update(original)
        t[f"{name}.g_idx"] = t[f"{name}.g_idx"].flip(0)

    _rewrite(tmp_path, act_order)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}.g_idx': input features out of group order"):
        LLM(tmp_path, mode="eager", max_model_len=64)

    def no_scales(t):
        t.update(original)
        del t[f"{name}.scales"]

    _rewrite(tmp_path, no_scales)
    with pytest.raises(CheckpointError, match=rf"GPTQ projection '{name}' lacks scales"):
        LLM(tmp_path, mode="eager", max_model_len=64)

    def wrong_shape(t):
        t.update(original)
        t[f"{name}.qweight"] = t[f"{name}.qweight"][:-1]

    _rewrite(tmp_path, wrong_shape)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}.qweight' has shape \(7, 128\)"):
        LLM(tmp_path, mode="eager", max_model_len=64)


@pytest.mark.parametrize("fields, match", [
    (dict(bits=8), r"bits=8 is not supported \(only 4\)"),
    (dict(sym=False), "sym=False is not supported"),
    (dict(desc_act=True), r"desc_act=True \(act-order\) is not supported"),
    (dict(group_size=-1), "group_size=-1 is not supported"),
    (dict(checkpoint_format="marlin"), "checkpoint_format='marlin' is not supported"),
    (dict(quant_method="awq"), "quant_method='awq'.*not supported; supported: 'gptq'"),
])
def test_quantization_configs_the_engine_does_not_read_name_the_field(tmp_path, fields, match):
    write_gptq_checkpoint(build_hf_model("llama3"), tmp_path, 128)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(fields)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"config\.json: config field quantization_config .*{match}"):
        LLM(tmp_path, mode="eager", max_model_len=64)


def test_a_gptq_checkpoint_refuses_another_quantization(gptq_checkpoint):
    with pytest.raises(ValueError, match="this checkpoint is already quantized .gptq, 4-bit"):
        LLM(gptq_checkpoint[0], mode="eager", max_model_len=64, quantization="int8")
