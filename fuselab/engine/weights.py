"""Weights: a Hugging Face safetensors checkpoint (sharded or not), or a random init for presets.

Only safetensors is read: a pickled checkpoint can run code when loaded. Q/K/V projections are
copied into their rows of the merged qkv_proj, gate/up into gate_up_proj, so each layer runs two
GEMMs where the checkpoint has five.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fuselab.engine.config import CheckpointError, read_json_object
from fuselab.engine.model import LlamaForCausalLM

# Tensors some checkpoints carry that the engine recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# The safetensors dtypes the loader casts from; integer or float8 tensors are quantized weights, or not weights.
_WEIGHT_DTYPES = ("F32", "BF16", "F16")


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: those its index names, else every *.safetensors."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise CheckpointError(f"{index}: field weight_map must map tensor names to file names")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {str(path)!r}: shards named in {index.name} are missing: {missing}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {str(path)!r} has no *.safetensors files (pickled .bin checkpoints are not "
                              "read)")
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
    """Copy every tensor of the checkpoint at `path` into `model` (cast to its dtype and device).
    A file that is not safetensors, a tensor with no place in the model, of another shape or of a
    dtype other than float32/bfloat16/float16, a parameter the checkpoint leaves empty, and NaN or
    inf in any weight are CheckpointErrors naming the file and the tensor."""
    params = dict(model.named_parameters())
    loaded: dict[str, Path] = {}  # checkpoint tensor -> its file
    finite: list[torch.Tensor] = []  # one device-side flag per tensor, read together at the end
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.lm_head is None):
                        continue  # tied checkpoints may still store lm_head: the embedding is the same matrix
                    if name in loaded:
                        raise CheckpointError(f"checkpoint {file}: tensor {name!r} is also in {loaded[name].name}")
                    dest = _destination(model, params, file, name, f.get_slice(name))
                    dest.copy_(f.get_tensor(name))
                    # After the cast: a value the model's dtype cannot hold is as wrong as a NaN.
                    finite.append(dest.isfinite().all())
                    loaded[name] = file
        except SafetensorError as e:
            raise CheckpointError(f"checkpoint {file}: not a readable safetensors file ({e})") from None
        except OSError as e:
            raise CheckpointError(f"checkpoint {file}: cannot be read ({e})") from None
    if finite and not (ok := torch.stack(finite).cpu()).all():  # one sync for the whole checkpoint
        name = list(loaded)[int((~ok).nonzero()[0])]
        dtype = str(params[_merged_slot(name, model)[0]].dtype).removeprefix("torch.")
        raise CheckpointError(f"checkpoint {loaded[name]}: tensor {name!r} holds NaN or inf values (as {dtype})")
    filled = Counter(_merged_slot(name, model)[0] for name in loaded)
    missing = [name for name, parts in _expected_parts(model).items() if filled.get(name, 0) < parts]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks weights for: {', '.join(missing[:8])}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _destination(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], file: Path, name: str,
                 view) -> torch.Tensor:
    """The parameter, or rows of it, that checkpoint tensor `name` fills, once its dtype and shape
    are checked from the file's header (`view`, a safetensors slice: nothing read yet)."""
    target, rows = _merged_slot(name, model)
    if target not in params:
        raise CheckpointError(f"checkpoint {file}: tensor {name!r} has no place in a {model.config.model_type} model")
    dest = params[target] if rows is None else params[target][rows]
    if view.get_dtype() not in _WEIGHT_DTYPES:
        raise CheckpointError(f"checkpoint {file}: tensor {name!r} has dtype {view.get_dtype()}; weights must be "
                              f"{', '.join(_WEIGHT_DTYPES)}")
    if tuple(view.get_shape()) != tuple(dest.shape):
        raise CheckpointError(f"checkpoint {file}: tensor {name!r} has shape {tuple(view.get_shape())}, the model "
                              f"expects {tuple(dest.shape)}")
    return dest


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
