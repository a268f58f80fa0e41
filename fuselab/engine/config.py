"""ModelConfig: the shape of a Llama-family model, read from a Hugging Face config.json or a preset.

One transformer covers Llama 2/3, Mistral, Qwen2 and Qwen3; they differ in a few switches
(biased QKV, per-head q/k RMSNorm, tied embeddings, Llama 3 rope scaling). Anything else a
config asks for is rejected here, naming the field, rather than silently computed wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The transformers class each model_type is saved from: another one under the same model_type (Mixtral's
# experts, say) has weights or layers this transformer does not compute.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}

# Presets are written as config.json dicts so that they go through the same parsing as a
# checkpoint, and so that a test can build the same shape in transformers from the same dict.
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
PRESETS: dict[str, dict] = {
    # Small enough for Triton's interpreter on a CPU; vocab >= 256 for byte-level prompts.
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=True, bos_token_id=None, eos_token_id=None),
    "llama3-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, tie_word_embeddings=True,
                      bos_token_id=128000, eos_token_id=128001),
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, tie_word_embeddings=False,
                      bos_token_id=128000, eos_token_id=128001),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
}


@dataclass(frozen=True)
class CheckpointQuantization:
    """What config.json's quantization_config says of a quantized checkpoint the engine reads: GPTQ,
    4-bit, symmetric (zero point 8), one scale per group of `group_size` input features, groups in
    order (desc_act false)."""

    method: str  # "gptq"
    bits: int
    group_size: int
    zero_offset: int  # added to the stored zero points: 1 in the "gptq" format (stored minus one), 0 in "gptq_v2"
    lm_head: bool  # whether lm_head is quantized too


GPTQ_GROUP_SIZES = (32, 64, 128)
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}


class CheckpointError(ValueError):
    """A checkpoint directory holds something the engine cannot read or does not implement; the
    message names the file and the field or tensor at fault."""


def read_json_object(path: Path) -> dict:
    """The JSON object in the file at `path`; anything else is a CheckpointError naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got a {type(value).__name__}")
    return value


def eos_token_ids(d: dict) -> tuple[int, ...]:
    """`eos_token_id` of a config.json or generation_config.json: absent, one id, or a list."""
    eos = d.get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"field eos_token_id must be an int >= 0 or a list of them, got {eos!r}")
    return tuple(ids)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # Llama 3's, or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    eos_token_ids: tuple[int, ...]
    dtype: str | None  # the checkpoint's dtype, e.g. "bfloat16"
    quantization: CheckpointQuantization | None = None  # a GPTQ checkpoint's scheme

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config field model_type={model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        _reject_unsupported(d, model_type)
        quantization = d.get("quantization_config")
        heads = _positive_int(d, "num_attention_heads")
        kv_heads = _positive_int(d, "num_key_value_heads") if d.get("num_key_value_heads") is not None else heads
        if heads % kv_heads:
            raise ValueError(f"config field num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
        hidden = _positive_int(d, "hidden_size")
        head_dim = _positive_int(d, "head_dim") if d.get("head_dim") is not None else hidden // heads
        rope = _rope_parameters(d)
        max_pos = _positive_int(d, "max_position_embeddings")
        if model_type == "mistral" and d.get("sliding_window"):
            # Attention over a window at least as long as the context is full attention: serve
            # contexts up to the window exactly, and no further.
            max_pos = min(max_pos, _positive_int(d, "sliding_window"))
        eos_ids = eos_token_ids(d)
        dtype = d.get("dtype", d.get("torch_dtype"))
        tied = d.get("tie_word_embeddings") or False
        if not isinstance(tied, bool):
            raise ValueError(f"config field tie_word_embeddings must be true or false, got {tied!r}")
        return cls(
            model_type=model_type,
            vocab_size=_positive_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(d, "intermediate_size"),
            num_layers=_positive_int(d, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float(d, "rms_norm_eps", 1e-6),
            rope_theta=_positive_float(rope, "rope_theta", 10000.0),
            rope_scaling=rope if rope.get("rope_type", "default") == "llama3" else None,
            max_position_embeddings=max_pos,
            tie_word_embeddings=tied,
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            dtype=dtype if isinstance(dtype, str) else None,
            quantization=None if quantization is None else _checkpoint_quantization(quantization),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"model directory {str(path)!r} has no config.json")
        fields = read_json_object(config_path)
        try:
            return cls.from_dict(fields)
        except ValueError as e:
            raise CheckpointError(f"{config_path}: {e}") from None

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls.from_dict(PRESETS[name])

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _positive_int(d: dict, field: str) -> int:
    value = d.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config field {field} must be a positive int, got {value!r}")
    return value


def _positive_float(d: dict, field: str, default: float) -> float:
    value = d.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"config field {field} must be a positive number, got {value!r}")
    return float(value)


def _rope_parameters(d: dict) -> dict:
    """transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"config field rope_scaling/rope_parameters must be an object, got {rope!r}")
    rope = dict(rope)
    rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_type"] = rope_type
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"config field rope_scaling/rope_parameters has rope_type={rope_type!r}; "
                         "supported: 'default' and 'llama3'")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config field partial_rotary_factor={rope['partial_rotary_factor']} is not supported (only 1.0)")
    return rope


def _reject_unsupported(d: dict, model_type: str) -> None:
    architectures = d.get("architectures")
    if architectures is not None and (not isinstance(architectures, list)
                                      or any(a != ARCHITECTURES[model_type] for a in architectures)):
        raise ValueError(f"config field architectures={architectures!r} is not supported for model_type="
                         f"{model_type!r} (only [{ARCHITECTURES[model_type]!r}])")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config field hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
    # Qwen2 always has a q/k/v bias; Llama's optional biases (q/k/v and o together) are not served.
    if d.get("attention_bias") and model_type != "qwen2":
        raise ValueError("config field attention_bias=true is not supported")
    if d.get("mlp_bias"):
        raise ValueError("config field mlp_bias=true is not supported")
    if d.get("use_sliding_window"):
        raise ValueError("config field use_sliding_window=true is not supported")
    layer_types = d.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError("config field layer_types: only 'full_attention' layers are supported")
    if d.get("pretraining_tp", 1) != 1:
        raise ValueError(f"config field pretraining_tp={d['pretraining_tp']} is not supported (only 1)")


def _checkpoint_quantization(q: object) -> CheckpointQuantization:
    """The GPTQ layouts AutoGPTQ, GPTQModel and transformers save; any other quantization_config is
    refused, naming the field."""
    if not isinstance(q, dict):
        raise ValueError(f"config field quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    where = f"config field quantization_config (quant_method={method!r})"
    if method != "gptq":
        raise ValueError(f"{where}: this quantization method is not supported; supported: 'gptq' (4-bit, sym, "
                         f"group size {', '.join(map(str, GPTQ_GROUP_SIZES))}, desc_act false)")
    if q.get("bits") != 4:
        raise ValueError(f"{where}: bits={q.get('bits')!r} is not supported (only 4)")
    group_size = q.get("group_size", 128)
    if group_size not in GPTQ_GROUP_SIZES:
        raise ValueError(f"{where}: group_size={group_size!r} is not supported "
                         f"({', '.join(map(str, GPTQ_GROUP_SIZES))})")
    if q.get("sym", True) is not True:
        raise ValueError(f"{where}: sym={q.get('sym')!r} is not supported: only symmetric checkpoints (zero point 8)")
    if q.get("desc_act", False) is not False:
        raise ValueError(f"{where}: desc_act={q.get('desc_act')!r} (act-order) is not supported: groups must be in "
                         "order")
    layout = q.get("checkpoint_format", q.get("format", "gptq"))
    if layout not in _GPTQ_FORMATS:
        raise ValueError(f"{where}: checkpoint_format={layout!r} is not supported ({', '.join(_GPTQ_FORMATS)})")
    lm_head = q.get("lm_head", False)
    if not isinstance(lm_head, bool):
        raise ValueError(f"{where}: lm_head must be true or false, got {lm_head!r}")
    return CheckpointQuantization("gptq", 4, group_size, _GPTQ_FORMATS[layout], lm_head)
