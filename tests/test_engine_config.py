"""ModelConfig from config.json dicts: what each architecture switches on, and what is refused; EngineConfig's
defaults and checks, resolved before any weight is built."""

from __future__ import annotations

import pytest
import torch

from fuselab.engine.config import PRESETS, ModelConfig
from fuselab.engine.engine_config import EngineConfig

_BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def test_llama3_preset_has_the_published_shape():
    c = ModelConfig.preset("llama3-1b")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == \
        (2048, 16, 32, 8, 8192, 128256)
    assert c.tie_word_embeddings and c.head_dim == 64 and c.rope_scaling["factor"] == 32.0
    c = ModelConfig.preset("llama3-8b")
    assert (c.hidden_size, c.num_layers, c.intermediate_size, c.head_dim, c.tie_word_embeddings) == \
        (4096, 32, 14336, 128, False)
    c = ModelConfig.preset("qwen3-0.6b")
    assert c.qk_norm and c.head_dim == 128 and c.q_size == 2048


def test_every_preset_parses():
    for name in PRESETS:
        ModelConfig.preset(name)


def test_architecture_switches():
    assert ModelConfig.from_dict({**_BASE, "model_type": "qwen2"}).qkv_bias
    assert ModelConfig.from_dict({**_BASE, "model_type": "qwen3", "head_dim": 32}).head_dim == 32
    llama = ModelConfig.from_dict({**_BASE, "model_type": "llama"})
    assert not (llama.qkv_bias or llama.qk_norm) and llama.head_dim == 16


def test_legacy_rope_fields_and_list_eos():
    c = ModelConfig.from_dict({**_BASE, "model_type": "llama", "rope_theta": 500000.0, "eos_token_id": [1, 2],
                               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})
    assert c.rope_theta == 500000.0 and c.rope_scaling["factor"] == 8.0 and c.eos_token_ids == (1, 2)


def test_mistral_sliding_window_bounds_the_context():
    c = ModelConfig.from_dict({**_BASE, "model_type": "mistral", "sliding_window": 128})
    assert c.max_position_embeddings == 128


@pytest.mark.parametrize("fields, match", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(model_type="llama", hidden_act="gelu"), "hidden_act"),
    (dict(model_type="llama", attention_bias=True), "attention_bias"),
    (dict(model_type="llama", mlp_bias=True), "mlp_bias"),
    (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
    (dict(model_type="qwen3", layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
    (dict(model_type="llama", rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(model_type="llama", num_key_value_heads=3), "num_key_value_heads"),
    (dict(model_type="llama", vocab_size=0), "vocab_size"),
    (dict(model_type="llama", head_dim="16"), "head_dim"),
    (dict(model_type="llama", tie_word_embeddings="yes"), "tie_word_embeddings"),
    (dict(model_type="llama", rope_scaling="llama3"), "rope_scaling"),
    (dict(model_type="llama", eos_token_id=["</s>"]), "eos_token_id"),
    (dict(model_type="qwen2", architectures=["LlamaForCausalLM"]), "architectures"),
    (dict(model_type="llama", quantization_config={"quant_method": "awq"}), "quant_method='awq'"),
])
def test_unsupported_configs_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**_BASE, **fields})


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="llama3-1b"):
        ModelConfig.preset("llama4")


def test_engine_config_resolves_its_defaults():
    c = EngineConfig("tiny", mode="eager", device="cpu")
    assert (c.max_model_len, c.max_num_batched_tokens, c.dtype, c.model_dir) == (2048, 8192, torch.float32, None)
    assert c.model_config == ModelConfig.preset("tiny") and c.blocks_per_seq == 2048 // 16
    assert EngineConfig("tiny", mode="eager", dtype="bf16", max_model_len=100, block_size=32).blocks_per_seq == 4


def test_engine_config_checks_a_given_cache_size_up_front():
    with pytest.raises(ValueError, match="fewer than one sequence"):
        EngineConfig("tiny", mode="eager", max_model_len=256, num_kv_blocks=15)
    EngineConfig("tiny", mode="eager", max_model_len=256, num_kv_blocks=16)
    with pytest.raises(ValueError, match="num_kv_blocks must be a positive int"):
        EngineConfig("tiny", mode="eager", num_kv_blocks=0)
