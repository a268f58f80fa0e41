"""Quantization in the engine: the `quantization` argument, and QuantizedLinear, a linear layer
whose weight lives in fuselab's packed int4 / int8 / fp8 layout.

`LLM(model, quantization=...)` quantizes a bf16/fp16/fp32 checkpoint (or a preset's random
weights) as it loads, a projection at a time, so the float model never exists on the GPU whole:

- "int4" (= "int4-g128"), "int4-g64", "int4-g32": 4-bit symmetric, a bf16 scale per group of 128,
  64 or 32 input features;
- "int8": 8-bit symmetric, an fp32 scale per output channel;
- "fp8": float8 e4m3, an fp32 scale per output channel.

The activations are rounded too, per row, where the kernels multiply 8-bit codes: int8 and fp8 from
W8A8_MIN_ROWS rows of x (W8A8), and at one row int8 and int4 on their large weights (int8 codes of x)
and fp8 on its largest (fuselab.kernels.quantized_linear.rounds_x); elsewhere they are weight-only.

Every linear layer is quantized, lm_head included. A model with tied embeddings keeps its
embedding matrix in the model's dtype for the token lookups, and its logits read a quantized
copy of it. A GPTQ checkpoint (config.json's quantization_config) loads its own 4-bit codes
(fuselab.engine.gptq) and keeps the float lm_head it ships.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fuselab.kernels.quant_pack import INT4_GROUP_SIZES, QuantizedWeight, packed_words, quantize_weight, scales_shape

QUANTIZATION_CHOICES = ("int4", *(f"int4-g{g}" for g in INT4_GROUP_SIZES), "int8", "fp8")
# Split-K tiles a layer's counters cover: split-K runs where the tiles of W leave SMs idle, so a
# product splits far fewer tiles than this (one with more falls back to a fresh buffer a call).
SPLIT_COUNTERS = 1024


@dataclass(frozen=True)
class QuantScheme:
    """How the engine's linear layers are quantized: resolved from the `quantization` argument or
    from a quantized checkpoint's config."""

    fmt: str  # "int4", "int8" or "fp8"
    group_size: int = 0  # int4: input features per scale
    scale_dtype: torch.dtype = torch.bfloat16  # int4's group scales (the 8-bit formats' are fp32)
    from_checkpoint: bool = False  # the checkpoint holds the codes (GPTQ) rather than float weights
    quantize_head: bool = True  # lm_head (or a tied embedding's copy) is quantized too

    @property
    def name(self) -> str:
        base = f"int4-g{self.group_size}" if self.fmt == "int4" else self.fmt
        return f"gptq-{base}" if self.from_checkpoint else base


def parse_quantization(value: object) -> QuantScheme | None:
    """The scheme a `quantization` argument names; None for None."""
    if value is None:
        return None
    if value not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES} or None, got {value!r}")
    if value.startswith("int4"):
        return QuantScheme("int4", int(value.partition("-g")[2] or 128))
    return QuantScheme(value)


class QuantizedLinear(nn.Module):
    """A linear layer with a packed weight: buffers `qweight` (int32 words) and `scales`, and an
    optional float bias. `weight` is the QuantizedWeight the kernels take, bound to the buffers by
    `bind()` once they are on their device (a model built on the meta device rebinds after
    to_empty). `in_major` records the float layer this one replaces (a weight stored [in, out]),
    so that a random init draws the same values as the float model's."""

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool, dtype: torch.dtype,
                 in_major: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme, self.in_major = in_features, out_features, scheme, in_major
        scale_dtype = scheme.scale_dtype if scheme.fmt == "int4" else torch.float32
        self.register_buffer("qweight", torch.empty(out_features, packed_words(in_features, scheme.fmt),
                                                    dtype=torch.int32))
        self.register_buffer("scales", torch.empty(scales_shape(out_features, in_features, scheme.fmt,
                                                                scheme.group_size), dtype=scale_dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.weight: QuantizedWeight | None = None

    def bind(self) -> None:
        # Ticket counters of its own for the kernels' split-K (kept at zero by them): no call zeroes fresh
        # ones, so no memset node stands between the decode graph's kernels. The engine runs one product
        # of a layer at a time.
        counters = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=self.qweight.device)
        self.weight = QuantizedWeight(self.qweight, self.scales, self.scheme.fmt, self.scheme.group_size,
                                      self.in_features, counters)

    def load_packed(self, weight: QuantizedWeight, rows: slice | None = None) -> None:
        """Copy packed rows (all of them, or `rows` of a merged projection) into the buffers."""
        rows = slice(None) if rows is None else rows
        self.qweight[rows].copy_(weight.data)
        self.scales[rows].copy_(weight.scales)

    def quantize_(self, weight: torch.Tensor, rows: slice | None = None) -> None:
        """Quantize a float weight [out, in] (or the rows `rows` of it) into the buffers."""
        self.load_packed(quantize_weight(weight, self.scheme.fmt, self.scheme.group_size or 128,
                                         self.scheme.scale_dtype), rows)

    def empty_float_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized float weight laid out as the float layer's (see `in_major`)."""
        device = self.qweight.device
        if self.in_major:
            return torch.empty(self.in_features, self.out_features, dtype=dtype, device=device).t()
        return torch.empty(self.out_features, self.in_features, dtype=dtype, device=device)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.name}"


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    """Each QuantizedLinear by the name of the float weight it stands for ("...qkv_proj.weight")."""
    return {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def bind_quantized(model: nn.Module) -> None:
    for layer in quantized_layers(model).values():
        layer.bind()


def weight_bytes(model: nn.Module) -> int:
    """GPU bytes of the model's weights: parameters and packed buffers (not the KV cache)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.nbytes for t in tensors.values())
