"""Torch references of the quantized linear op: the packed layout read back element by element.

Written from the layout's definition (fuselab.kernels.quant_pack) independently of the Triton
kernels, which the tests compare against `dequantize(..., torch.float64)`. The engine's eager
mode runs `quantized_linear` (a dequantized copy of the weight per call: slow, but plain torch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fuselab.kernels.quant_pack import BLOCK_WORDS, FP8_MAX, QuantizedWeight, _BITS, values_per_word
from fuselab.kernels.quantized_linear import rounds_x


def unpack_codes(weight: QuantizedWeight) -> torch.Tensor:
    """The unsigned codes [N, in_features] (int64) of a packed weight."""
    n = weight.data.shape[0]
    bits, per_word = _BITS[weight.fmt], values_per_word(weight.fmt)
    words = (weight.data.to(torch.int64) & 0xFFFFFFFF).view(n, -1, 1, BLOCK_WORDS)  # [row, block, 1, word i]
    shifts = torch.arange(per_word, device=words.device).view(1, 1, per_word, 1) * bits
    codes = (words >> shifts) & ((1 << bits) - 1)  # [row, block, code j, word i]: element 16·j + i of the block
    return codes.view(n, -1)[:, : weight.in_features]


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The weight [N, in_features] the codes and scales stand for, computed in float64, returned as `dtype`."""
    codes = unpack_codes(weight)
    k = weight.in_features
    if weight.fmt == "int4":
        scales = weight.scales.double().repeat_interleave(weight.group_size, dim=1)[:, :k]
        values = (codes - 8).double() * scales
    elif weight.fmt == "int8":
        values = (codes - 128).double() * weight.scales.double()[:, None]
    else:
        values = codes.to(torch.uint8).view(torch.float8_e4m3fn).double() * weight.scales.double()[:, None]
    return values.to(dtype)


def quantize_activations(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows as W8A8 rounds them for a weight of `fmt`: (codes [..., K], scales float32 [...]).
    fp8: s = max(amax(|row|) / 448, fp32's smallest normal), codes = e4m3(x / s) to nearest even
    (float8_e4m3fn); int8: s = max(amax / 127, the same floor), codes = round(x / s) to nearest even
    within [-127, 127] (int8)."""
    xf = x.float()
    code_max = 127.0 if fmt == "int8" else FP8_MAX
    scales = (xf.abs().amax(dim=-1) / code_max).clamp(min=torch.finfo(torch.float32).tiny)
    scaled = (xf / scales[..., None]).clamp(-code_max, code_max)
    return (scaled.round().to(torch.int8) if fmt == "int8" else scaled.to(torch.float8_e4m3fn)), scales


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """x · dequantize(weight)ᵀ (+ bias) in x's dtype; into `out` when given. An int8 or fp8 weight
    multiplies x's rows rounded (in fp32) where and as the kernels round them (`rounds_x`)."""
    x_format = rounds_x(math.prod(x.shape[:-1]), weight)
    if x_format is not None:
        codes, scales = quantize_activations(x, x_format)
        y = F.linear(codes.float() * scales[..., None], dequantize(weight, torch.float32),
                     None if bias is None else bias.float()).to(x.dtype)
    else:
        y = F.linear(x, dequantize(weight, x.dtype), bias)
    return y if out is None else out.copy_(y)
