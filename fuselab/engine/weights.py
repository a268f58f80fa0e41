"""Weights: a Hugging Face safetensors checkpoint (sharded or not), or a random init for presets.

Only safetensors is read: a pickled checkpoint can run code when loaded. Q/K/V projections are
copied into their rows of the merged qkv_proj, gate/up into gate_up_proj, so each layer runs two
GEMMs where the checkpoint has five. A quantized model (QuantizedLinear projections) quantizes each
float projection as it is read, or, from a GPTQ checkpoint, repacks its 4-bit codes
(fuselab.engine.gptq); a random init quantizes the very weights the float model would draw.
A tensor-parallel rank's model reads only its slice of each split projection (fuselab.engine.parallel).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fuselab.engine import gptq
from fuselab.engine.config import CheckpointError, read_json_object
from fuselab.engine.model import LlamaForCausalLM
from fuselab.engine.parallel import full_shape, read_shard, split_dim
from fuselab.engine.quantize import QuantizedLinear, quantized_layers

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
    """How many checkpoint tensors fill each parameter (or quantized layer's weight): 3 for
    qkv_proj, 2 for gate_up_proj, else 1. A tied model's quantized head copies the embedding."""
    names = [name for name, _ in model.named_parameters()]
    names += [name for name in quantized_layers(model)
              if not (model.head_copies_embedding and name == "lm_head.weight")]
    return {name: 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1 for name in names}


@torch.no_grad()
def load_checkpoint(model: LlamaForCausalLM, path: str | Path) -> None:
    """Copy every tensor of the checkpoint at `path` into `model` (cast to its dtype and device;
    quantized into a QuantizedLinear's buffers, or repacked from GPTQ's). A file that is not
    safetensors, a tensor with no place in the model, of another shape or of a dtype other than
    float32/bfloat16/float16 (int32 for GPTQ's codes), a parameter the checkpoint leaves empty, and
    NaN or inf in any weight are CheckpointErrors naming the file and the tensor."""
    params = dict(model.named_parameters())
    quantized = quantized_layers(model)
    from_gptq = model.config.quantization is not None
    pending: dict[str, dict[str, tuple[torch.Tensor, Path]]] = {}  # GPTQ tensors by projection
    loaded: dict[str, Path] = {}  # checkpoint tensor -> its file
    finite: list[torch.Tensor] = []  # one device-side flag per tensor, read together at the end
    checked: list[tuple[str, torch.dtype]] = []  # the tensor each flag is of, and the dtype it was checked in
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    gptq_part = gptq.split_name(name) if from_gptq else None
                    if name.endswith(_IGNORED_SUFFIXES) or (model.config.tie_word_embeddings and (
                            name == "lm_head.weight" or gptq_part is not None and gptq_part[0] == "lm_head")):
                        continue  # tied checkpoints may still store lm_head: the embedding is the same matrix
                    if name in loaded:
                        raise CheckpointError(f"checkpoint {file}: tensor {name!r} is also in {loaded[name].name}")
                    loaded[name] = file
                    if gptq_part is not None and _merged_slot(gptq_part[0] + ".weight", model)[0] in quantized:
                        pending.setdefault(gptq_part[0], {})[gptq_part[1]] = (f.get_tensor(name), file)
                        continue
                    target, rows = _merged_slot(name, model)
                    if target in quantized and not from_gptq:
                        layer = quantized[target]
                        weight = _read_float(f, file, name, model, _float_shape(layer, rows))
                        layer.quantize_(weight, rows)
                    else:
                        view = f.get_slice(name)
                        weight = _destination(model, params, file, name, view)
                        weight.copy_(_read(f, view, name, model))
                    # After the cast: a value the model's dtype cannot hold is as wrong as a NaN.
                    finite.append(weight.isfinite().all())
                    checked.append((name, weight.dtype))
        except SafetensorError as e:
            raise CheckpointError(f"checkpoint {file}: not a readable safetensors file ({e})") from None
        except OSError as e:
            raise CheckpointError(f"checkpoint {file}: cannot be read ({e})") from None
    for prefix, parts in pending.items():
        scales = _load_gptq(model, quantized, prefix, parts)
        finite.append(scales.isfinite().all())
        checked.append((f"{prefix}.scales", scales.dtype))
    if finite and not (ok := torch.stack(finite).cpu()).all():  # one sync for the whole checkpoint
        name, dtype = checked[int((~ok).nonzero()[0])]
        raise CheckpointError(f"checkpoint {loaded[name]}: tensor {name!r} holds NaN or inf values (as "
                              f"{str(dtype).removeprefix('torch.')})")
    if model.head_copies_embedding:
        model.lm_head.quantize_(model.model.embed_tokens.weight)
    _release_float_copies(quantized)
    filled = Counter(_merged_slot(name, model)[0] for name in loaded if gptq.split_name(name) is None
                     or not from_gptq)
    filled.update(_merged_slot(prefix + ".weight", model)[0] for prefix, parts in pending.items() if "qweight" in parts)
    missing = [name for name, parts in _expected_parts(model).items() if filled.get(name, 0) < parts]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks weights for: {', '.join(missing[:8])}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))


def _float_shape(layer: QuantizedLinear, rows: slice | None) -> tuple[int, int]:
    out = layer.out_features if rows is None else rows.stop - rows.start
    return out, layer.in_features


def _read_float(f, file: Path, name: str, model: LlamaForCausalLM, shape: tuple[int, int]) -> torch.Tensor:
    """A float projection to quantize, checked from the header first, then read and cast to the
    model's dtype on its device."""
    view = f.get_slice(name)
    if view.get_dtype() not in _WEIGHT_DTYPES:
        raise CheckpointError(f"checkpoint {file}: tensor {name!r} has dtype {view.get_dtype()}; weights must be "
                              f"{', '.join(_WEIGHT_DTYPES)}")
    if tuple(view.get_shape()) != shape:
        raise CheckpointError(f"checkpoint {file}: tensor {name!r} has shape {tuple(view.get_shape())}, the model "
                              f"expects {shape}")
    norm = model.model.norm.weight
    return f.get_tensor(name).to(device=norm.device, dtype=norm.dtype)


def _load_gptq(model: LlamaForCausalLM, quantized: dict[str, QuantizedLinear], prefix: str,
               parts: dict[str, tuple[torch.Tensor, Path]]) -> torch.Tensor:
    """Repack one GPTQ projection (a q/k/v or gate/up part of a merged one too) into its rows;
    returns its scales, to be checked for NaN with the rest."""
    target, rows = _merged_slot(prefix + ".weight", model)
    layer = quantized[target]
    missing = [p for p in gptq.REQUIRED if p not in parts]
    if missing:
        file = next(iter(parts.values()))[1]
        raise CheckpointError(f"checkpoint {file}: GPTQ projection {prefix!r} lacks {', '.join(missing)}")
    device = layer.qweight.device
    tensors = {p: t.to(device) for p, (t, _) in parts.items()}
    where = {p: f"checkpoint {file}: tensor '{prefix}.{p}'" for p, (_, file) in parts.items()}
    out_features = layer.out_features if rows is None else rows.stop - rows.start
    packed = gptq.to_packed(tensors, where, layer.in_features, out_features, model.config.quantization,
                            layer.scales.dtype)
    layer.load_packed(packed, rows)
    return packed.scales


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
    expected = tuple(dest.shape)
    dim = _split_dim(name, model)
    if dim is not None:
        expected = full_shape(expected, dim, model.tensor_parallel.size)
    if tuple(view.get_shape()) != expected:
        raise CheckpointError(f"checkpoint {file}: tensor {name!r} has shape {tuple(view.get_shape())}, the model "
                              f"expects {expected}")
    return dest


def _split_dim(name: str, model: LlamaForCausalLM) -> int | None:
    """The dim a tensor-parallel rank reads a slice of; None: it reads the whole tensor."""
    return None if model.tensor_parallel is None else split_dim(name)


def _read(f, view, name: str, model: LlamaForCausalLM) -> torch.Tensor:
    dim = _split_dim(name, model)
    return f.get_tensor(name) if dim is None else read_shard(view, dim, model.tensor_parallel)


@torch.no_grad()
def init_random(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights of a trained model's scale (normal, std 0.02; norms 1; biases 0), drawn on
    the model's device so that an 8B model is initialized in seconds. A quantized projection
    draws the float weight its float model would (same seed, same layout), then quantizes it."""
    for name, target in _init_order(model):
        device = target.qweight.device if isinstance(target, QuantizedLinear) else target.device
        generator = torch.Generator(device).manual_seed(seed)
        seed += 1
        if isinstance(target, QuantizedLinear):
            weight = target.empty_float_weight(model.model.embed_tokens.weight.dtype)
            target.quantize_(weight.normal_(0.0, 0.02, generator=generator))
        elif "norm" in name:
            target.fill_(1.0)
        elif name.endswith(".bias"):
            target.zero_()
        else:
            target.normal_(0.0, 0.02, generator=generator)
    if model.head_copies_embedding:
        model.lm_head.quantize_(model.model.embed_tokens.weight)
    _release_float_copies(quantized_layers(model))


def _release_float_copies(quantized: dict[str, QuantizedLinear]) -> None:
    """Quantizing left the float weights it read in the caching allocator: hand them back, so that
    the KV cache, sized from the GPU's free memory next, takes the memory quantization saved."""
    if quantized and next(iter(quantized.values())).qweight.is_cuda:
        torch.cuda.empty_cache()


def _init_order(model: LlamaForCausalLM):
    """(name, parameter or QuantizedLinear) in named_parameters' order, a quantized projection where
    its float weight would be, so that each draws the same seed as in the float model. A head that
    copies the embedding has no draw of its own."""
    for prefix, module in model.named_modules():
        if isinstance(module, QuantizedLinear) and not (model.head_copies_embedding and module is model.lm_head):
            yield f"{prefix}.weight", module
        for name, param in module.named_parameters(prefix, recurse=False):
            yield name, param
