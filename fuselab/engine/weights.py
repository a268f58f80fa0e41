"""Weights: a Hugging Face safetensors checkpoint (sharded or not), or a random init for presets.

Only safetensors is read: a pickled checkpoint can run code when loaded. Q/K/V projections are
copied into their rows of the merged qkv_proj, gate/up into gate_up_proj, so each layer runs two
GEMMs where the checkpoint has five.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from fuselab.engine.model import LlamaForCausalLM

# Tensors some checkpoints carry that the engine recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: those its index names, else every *.safetensors."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ValueError(f"checkpoint {str(path)!r}: shards named in {index.name} are missing: {missing}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint {str(path)!r} has no *.safetensors files (pickled .bin checkpoints are not read)")
    return files


def _merged_slot(name: str, model: LlamaForCausalLM) -> tuple[str, slice | None]:
    """Where a checkpoint tensor goes: (parameter name, rows of it, or None for the whole)."""
    c = model.config
    merged = {
        "self_attn.q_proj.": ("self_attn.qkv_proj.", 0, c.q_size),
        "self_attn.k_proj.": ("self_attn.qkv_proj.", c.q_size, c.kv_size),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", c.q_size + c.kv_size, c.kv_size),
        "mlp.gate_proj.": ("mlp.gate_up_proj.", 0, c.intermediate_size),
        "mlp.up_proj.": ("mlp.gate_up_proj.", c.intermediate_size, c.intermediate_size),
    }
    for part, (target, start, rows) in merged.items():
        if part in name:
            return name.replace(part, target), slice(start, start + rows)
    return name, None


def _expected_parts(model: LlamaForCausalLM) -> dict[str, int]:
    """How many checkpoint tensors fill each parameter: 3 for qkv_proj, 2 for gate_up_proj, else 1."""
    return {name: 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1
            for name, _ in model.named_parameters()}


@torch.no_grad()
def load_checkpoint(model: LlamaForCausalLM, path: str | Path) -> None:
    """Copy every tensor of the checkpoint at `path` into `model` (cast to its dtype and device);
    a tensor with no place in the model, or a parameter the checkpoint leaves empty, is an error."""
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
                    continue  # tied checkpoints may still store lm_head: the embedding is the same matrix
                target, rows = _merged_slot(name, model)
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} ({file.name}) has no place in a "
                                     f"{model.config.model_type} model")
                dest = params[target] if rows is None else params[target][rows]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(dest.shape)}")
                dest.copy_(tensor)
                filled[target] = filled.get(target, 0) + 1
    missing = [name for name, parts in _expected_parts(model).items() if filled.get(name, 0) < parts]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks weights for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


@torch.no_grad()
def init_random(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights of a trained model's scale (normal, std 0.02; norms 1; biases 0), drawn on
    the model's device so that an 8B model is initialized in seconds."""
    for name, param in model.named_parameters():
        generator = torch.Generator(param.device).manual_seed(seed)
        seed += 1
        if "norm" in name:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=generator)
