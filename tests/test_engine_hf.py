"""The engine against transformers: tiny random checkpoints of each architecture, saved with
save_pretrained and served by LLM, give the same greedy tokens as transformers' generate (float32).
On the CPU, "fused" runs Triton's interpreter; on a GPU these tests run compiled, on CUDA."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_checkpoints import ARCHITECTURES, build_hf_model, hf_greedy, save_checkpoint
from fuselab import kernels
from fuselab.kernels import embedding
from fuselab.engine import LLM, SamplingParams

PROMPT_LENGTHS = (1, 7, 33, 70)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (transformers model, checkpoint dir), built once per module."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: (model := build_hf_model(arch), save_checkpoint(model, root / arch)) for arch in ARCHITECTURES}


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_tokens_match_transformers_eager(checkpoints, arch):
    hf_model, path = checkpoints[arch]
    prompts = _prompts(PROMPT_LENGTHS)
    expected = [hf_greedy(hf_model, p, 12) for p in prompts]
    llm = LLM(path, mode="eager", dtype="float32")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)


def test_cublas_only_projections_are_stored_in_major(checkpoints):
    # gate/up and an untied lm_head are stored [in, out] (W transposed, x · Wᵀ reads it row-major);
    # the loader's row slices of the merged gate/up write into that layout, as the tokens above show.
    _, path = checkpoints["qwen2"]
    model = LLM(path, mode="eager", dtype="float32").model
    for weight in (model.lm_head.weight, model.model.layers[0].mlp.gate_up_proj.weight):
        assert weight.stride() == (1, weight.shape[0])
    assert model.model.layers[0].self_attn.qkv_proj.weight.is_contiguous()  # the GEMV reads rows


@pytest.mark.filterwarnings("ignore:mode 'fused' on the CPU")
def test_greedy_tokens_match_transformers_fused(checkpoints):
    # Triton's interpreter is slow: a short run of the Llama 3 case (GQA, rope scaling).
    hf_model, path = checkpoints["llama3"]
    prompts = _prompts((1, 9, 40))
    expected = [hf_greedy(hf_model, p, 5) for p in prompts]
    llm = LLM(path, mode="fused", dtype="float32", max_model_len=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5))
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.filterwarnings("ignore:mode 'fused' on the CPU")
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "llama2-tied"])
def test_one_row_decode_with_the_norms_folded_matches_transformers(checkpoints, arch, monkeypatch):
    # One sequence decodes a row a step: the norms' weights live in q/k/v and gate/up, the residual adds
    # in the projections' epilogues, and each norm's 1 / rms in the op after it.
    from fuselab.engine.model import DecoderLayer

    hf_model, path = checkpoints[arch]
    prompt = _prompts((11,), seed=1)[0]
    expected = hf_greedy(hf_model, prompt, 6)
    folded_calls, forward_folded = [], DecoderLayer.forward_folded
    monkeypatch.setattr(DecoderLayer, "forward_folded", lambda *a: folded_calls.append(1) or forward_folded(*a))
    swiglu_gemvs, rms_linear_swiglu = [], kernels.rms_linear_swiglu
    monkeypatch.setattr(kernels, "rms_linear_swiglu", lambda *a: swiglu_gemvs.append(1) or rms_linear_swiglu(*a))
    lookups, embedding_launch = [], embedding.embedding_launch
    monkeypatch.setattr(embedding, "embedding_launch", lambda *a: lookups.append(1) or embedding_launch(*a))
    final_norms, rms_linear = [], kernels.rms_linear
    monkeypatch.setattr(kernels, "rms_linear", lambda *a, **kw: final_norms.append(kw.get("norm_weight") is not None)
                        or rms_linear(*a, **kw))
    llm = LLM(path, mode="fused", dtype="float32", max_model_len=64)
    layers = llm.model.model.layers
    assert llm.model.norms_folded and all((layer.input_layernorm.weight == 1).all() for layer in layers)
    # gate/up stored as (gate, up) row pairs: gate row i, then up row i, of transformers' weights times g.
    mlp, hf_layer = layers[0].mlp, hf_model.model.layers[0]
    g = hf_layer.post_attention_layernorm.weight.detach()
    assert torch.allclose(mlp.gate_up_proj.weight[0::2].cpu(), hf_layer.mlp.gate_proj.weight.detach() * g)
    assert torch.allclose(mlp.gate_up_proj.weight[1::2].cpu(), hf_layer.mlp.up_proj.weight.detach() * g)
    outputs = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))
    assert outputs[0].token_ids == expected
    assert len(folded_calls) == 5 * len(layers)  # every decode step (the first token is the prefill's)
    assert len(swiglu_gemvs) == 5 * len(layers)  # the norm, gate/up and SwiGLU in one op a layer
    assert len(lookups) == 5  # each step's token picked and its row read in one launch
    assert final_norms.count(True) == 5  # the final norm taken by the logits projection's op


def test_eager_mode_keeps_the_norms_weights(checkpoints):
    hf_model, path = checkpoints["llama3"]
    model = LLM(path, mode="eager", dtype="float32").model
    assert not model.norms_folded
    ours, theirs = model.model.layers[0].input_layernorm.weight, hf_model.model.layers[0].input_layernorm.weight
    assert ours.cpu().equal(theirs.cpu())
    with pytest.raises(ValueError, match="not eager"):  # the reference has no folded step to run
        model.fold_norms()


def test_sharded_checkpoint_loads_like_one_file(checkpoints, tmp_path):
    hf_model, _ = checkpoints["qwen2"]
    path = save_checkpoint(hf_model, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    prompts = _prompts((5, 20))
    expected = [hf_greedy(hf_model, p, 8) for p in prompts]
    outputs = LLM(path, mode="eager", dtype="float32").generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [o.token_ids for o in outputs] == expected


def _copy_checkpoint(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_checkpoint_missing_a_tensor_is_rejected(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints["llama3"][1], tmp_path / "ckpt",
                            lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        LLM(path, mode="eager")


def test_checkpoint_with_a_foreign_tensor_is_rejected(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints["llama3"][1], tmp_path / "ckpt",
                            lambda t: t.update({"model.vision_tower.weight": t["model.norm.weight"].clone()}))
    with pytest.raises(ValueError, match="vision_tower"):
        LLM(path, mode="eager")


def test_checkpoint_without_safetensors_is_rejected(checkpoints, tmp_path):
    (tmp_path / "config.json").write_text((checkpoints["llama3"][1] / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        LLM(tmp_path, mode="eager")


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(tmp_path)


def test_string_prompts_use_the_checkpoints_tokenizer(checkpoints, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    hf_model, _ = checkpoints["llama3"]
    path = save_checkpoint(hf_model, tmp_path / "with_tokenizer")
    vocab = {f"w{i}": i for i in range(256)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))

    llm = LLM(path, mode="eager", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=6)
    by_text = llm.generate("w5 w17 w200", params)[0]
    by_ids = llm.generate([5, 17, 200], params)[0]
    assert by_text.prompt_token_ids == [5, 17, 200]
    assert by_text.token_ids == by_ids.token_ids == hf_greedy(hf_model, [5, 17, 200], 6)
    assert by_text.text == " ".join(f"w{t}" for t in by_text.token_ids)
