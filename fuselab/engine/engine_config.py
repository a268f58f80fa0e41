"""EngineConfig: the engine's settings, checked and resolved in one place.

`LLM(...)` takes them as keyword arguments and builds this; everything downstream reads the
resolved values (a torch.device, a torch.dtype, the mode that actually runs, the model's config).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fuselab.device import default_device, has_cuda
from fuselab.engine.config import PRESETS, ModelConfig
from fuselab.engine.quantize import QuantScheme, parse_quantization
from fuselab.engine.sampling_params import is_int
from fuselab.kernels import ATTENTION_HEAD_DIMS

MODES = ("eager", "fused", "graphs")
# Block tables and the decode split count are sized from max_model_len; Llama 3's 128k context
# would make every decode step pay for it. Ask for more explicitly.
DEFAULT_MAX_MODEL_LEN = 4096
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
# Each fallback warning is said once per process, not once per engine built.
_warned: set[str] = set()


@dataclass
class EngineConfig:
    """The arguments of `LLM` (see there). Construction validates every one, naming it in the
    error, and resolves the defaults: afterwards `device` is a torch.device, `dtype` a
    torch.dtype, `mode` the mode that runs ("graphs" runs "eager" without a GPU), `quantization`
    a QuantScheme (from the argument, or from a GPTQ checkpoint's config) or None, and
    `max_model_len` and `max_num_batched_tokens` are ints. num_kv_blocks stays None when the
    cache is to be sized from free memory (known only once the weights are loaded).
    tensor_parallel_size must divide the model's attention and KV heads and its MLP width, fit
    the visible GPUs, and comes with unquantized weights only (fuselab.engine.parallel)."""

    model: str | os.PathLike
    mode: str = "graphs"
    dtype: str | torch.dtype | None = None
    device: str | torch.device | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    kv_cache_memory_fraction: float = 0.9
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    quantization: str | QuantScheme | None = None
    tensor_parallel_size: int = 1
    model_dir: Path | None = field(init=False)  # the checkpoint directory; None for a preset
    model_config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        self.model_dir, self.model_config = resolve_model(self.model)
        config = self.model_config
        self.device = _resolve_device(self.device)
        self.mode = _resolve_mode(self.mode, self.device)
        self.dtype = _resolve_dtype(self.dtype, config, self.device)
        self.quantization = _resolve_quantization(self.quantization, config, self.device)
        _check_tensor_parallel(self.tensor_parallel_size, config, self.device, self.quantization)
        if self.mode != "eager" and config.head_dim not in ATTENTION_HEAD_DIMS:
            raise ValueError(f"mode {self.mode!r} needs a head dim in {ATTENTION_HEAD_DIMS}; this model's is "
                             f"{config.head_dim} (use mode='eager')")
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is None:
            self.max_model_len = min(DEFAULT_MAX_MODEL_LEN, config.max_position_embeddings)
        _check_positive_int("max_model_len", self.max_model_len)
        if self.max_model_len < 2 or self.max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {config.max_position_embeddings}] for this model, "
                             f"got {self.max_model_len}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(self.max_model_len, 8192)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_model_len ({self.max_model_len}), so that the longest prompt can be prefilled")
        fraction = self.kv_cache_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction!r}")
        if self.num_kv_blocks is not None:
            _check_positive_int("num_kv_blocks", self.num_kv_blocks)
            self.check_num_kv_blocks(self.num_kv_blocks)

    @property
    def blocks_per_seq(self) -> int:
        """KV-cache blocks that one sequence of max_model_len tokens fills."""
        return -(-self.max_model_len // self.block_size)

    def check_num_kv_blocks(self, num_kv_blocks: int) -> None:
        """A cache of num_kv_blocks must hold the longest sequence, or it could never be scheduled."""
        if num_kv_blocks < self.blocks_per_seq:
            raise ValueError(f"the KV cache holds {num_kv_blocks} blocks of {self.block_size} tokens, fewer than "
                             f"one sequence of max_model_len={self.max_model_len} needs ({self.blocks_per_seq}): "
                             "lower max_model_len or give the cache more memory")


def _check_positive_int(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_tensor_parallel(size: object, config: ModelConfig, device: torch.device,
                           quantization: QuantScheme | None) -> None:
    if not is_int(size) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
    if size == 1:
        return
    widths = {"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
              "intermediate_size": config.intermediate_size}
    uneven = [f"{name} ({width})" for name, width in widths.items() if width % size]
    if uneven:
        # Each rank holds whole heads (its KV heads' share of the cache) and an equal slice of the MLP.
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {' and '.join(uneven)}")
    if quantization is not None:
        raise ValueError(f"tensor_parallel_size={size} takes unquantized weights only in this release: drop "
                         "quantization (or run tensor_parallel_size=1)")
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(f"tensor_parallel_size={size} places rank r on cuda:r: pass device='cuda', "
                             f"not {str(device)!r}")
        visible = torch.cuda.device_count()
        if size > visible:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, one per rank; {visible} "
                             f"{'is' if visible == 1 else 'are'} visible")


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        # Frames: _warn_once, _resolve_mode, __post_init__, the dataclass __init__, LLM.__init__, its caller.
        warnings.warn(message, stacklevel=6)


def resolve_model(model: object) -> tuple[Path | None, ModelConfig]:
    """(checkpoint directory or None for a preset, its config): config.json only, no weights read."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a checkpoint directory or a preset name, got {type(model).__name__}")
    path = Path(model)
    if path.is_dir():
        return path, ModelConfig.from_dir(path)
    if isinstance(model, str) and model in PRESETS:
        return None, ModelConfig.preset(model)
    if path.is_file():
        raise ValueError(f"model {str(model)!r} is a file: pass the checkpoint directory that holds it")
    raise ValueError(f"model {str(model)!r} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})")


def _resolve_device(device: object) -> torch.device:
    if device is None:
        return default_device()
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device: {e}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {str(device)!r}")
    if device.type == "cuda" and not has_cuda():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is available")
    return device


def _resolve_mode(mode: object, device: torch.device) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if device.type == "cpu" and mode == "graphs":
        _warn_once("mode 'graphs' needs a CUDA GPU: running mode 'eager' on the CPU")
        return "eager"
    if device.type == "cpu" and mode == "fused":
        _warn_once("mode 'fused' on the CPU runs the Triton kernels through the interpreter: slow, tiny models only")
    return mode


def _resolve_dtype(dtype: object, config: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype is None:
        if device.type == "cpu":
            return torch.float32
        return torch.float16 if config.dtype == "float16" else torch.bfloat16
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        return dtype
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch dtype among them, got {dtype!r}")


def _resolve_quantization(value: object, config: ModelConfig, device: torch.device) -> QuantScheme | None:
    scheme = value if isinstance(value, QuantScheme) else parse_quantization(value)
    checkpoint = config.quantization
    if isinstance(value, QuantScheme):
        return value
    if checkpoint is not None:
        if scheme is not None:
            raise ValueError(f"quantization={value!r}: this checkpoint is already quantized ({checkpoint.method}, "
                             f"{checkpoint.bits}-bit, group {checkpoint.group_size}); leave quantization unset")
        return QuantScheme("int4", checkpoint.group_size, torch.float16, from_checkpoint=True,
                           quantize_head=checkpoint.lm_head)
    if scheme is not None and scheme.fmt == "fp8" and device.type == "cuda" \
            and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("quantization='fp8' needs a GPU of compute capability 8.9 or newer (float8 e4m3 "
                         f"conversions); this one is {'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    return scheme
