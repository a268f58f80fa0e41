"""Tiny random Hugging Face checkpoints of each architecture the engine serves, and transformers'
greedy tokens for them: the ground truth of the engine tests. Built locally; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

# Small enough for Triton's interpreter; head_dim 16 is the smallest the fused kernels take.
_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
              bos_token_id=None, eos_token_id=None, pad_token_id=None,
              # Larger than a trained model's 0.02, so that greedy tokens vary instead of repeating one.
              initializer_range=0.15)
_LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=32)

ARCHITECTURES = {
    "llama3": ("LlamaConfig", dict(rope_parameters=_LLAMA3_ROPE)),
    "llama2-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),
}
MODEL_CLASSES = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM",
                 "Qwen2Config": "Qwen2ForCausalLM", "Qwen3Config": "Qwen3ForCausalLM"}


def build_hf_model(arch: str, seed: int = 0, **overrides):
    """A random float32 transformers model of `arch`, with norms and biases perturbed away from
    their 1 / 0 init so that a wrong norm or a dropped bias changes the tokens."""
    import transformers

    config_name, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**{**_SHAPE, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[config_name])(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.2)
    return model


def save_checkpoint(model, path: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (no padding, so nothing but the model differs)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()
