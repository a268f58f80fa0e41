"""The packed weight layout of fuselab's quantized linear kernels, and the quantizers that fill it.

A quantized weight [N, K] is N rows of 32-bit words. Each row is cut into blocks of 16 words:
128 elements for int4 (8 codes a word), 64 for int8 and fp8 (4 a word). Inside a block, code j of
word i is element 16·j + i: the j-th code of 16 neighbouring words covers 16 consecutive elements
of the row. A kernel that reads a run of words (16-byte loads, rows contiguous) and takes code j
of each gets the weights of a contiguous run of x, so the dequantized chunk multiplies a plain
slice of the activations (for a GEMV) or feeds a tl.dot with K = 16 per block (for a GEMM); no
shuffle of nibbles is needed after the load. Rows are padded to whole blocks with codes of zero.

Codes are stored unsigned: int4 as q + 8 (q in [-8, 7]), int8 as q + 128 (q in [-127, 127]),
fp8 as the float8_e4m3fn bits. Scales, symmetric (no zero point):

- int4: one per group of `group_size` (32, 64 or 128) elements along K, [N, K_padded / group_size],
  bfloat16 when quantized here (float16 when read from a GPTQ checkpoint, as stored);
- int8 and fp8: one per output channel, [N] float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

QUANT_FORMATS = ("int4", "int8", "fp8")
INT4_GROUP_SIZES = (32, 64, 128)
BLOCK_WORDS = 16
_BITS = {"int4": 4, "int8": 8, "fp8": 8}
_PAD_CODE = {"int4": 8, "int8": 128, "fp8": 0}  # each format's code of the value 0
# Rows quantized at a time: bounds the float32 temporaries (an 8B lm_head is 128256 rows).
_ROWS_PER_CHUNK = 8192
FP8_MAX = 448.0  # the largest float8_e4m3fn
# The int4 grid is q · s for q in [-8, 7]; s = amax / 7.5 puts ±amax half a step outside it, so
# that no weight is more than s/2 from its code (GPTQ's symmetric scale, (2 · amax) / 15).
_INT4_STEPS = 7.5


class QuantizedWeight(NamedTuple):
    """A weight [out_features, in_features] in fuselab's packed layout (see the module docstring)."""

    data: torch.Tensor  # int32 [out_features, packed_words(in_features, fmt)]
    scales: torch.Tensor  # int4: [out_features, groups] bf16/fp16; int8, fp8: [out_features] fp32
    fmt: str  # "int4", "int8" or "fp8"
    group_size: int  # int4: elements per scale; 0 for the per-channel formats
    in_features: int
    # int32 ticket counters at zero that the split-K launches of this weight use (and leave at zero), so
    # that no call zeroes fresh ones; None: a fresh buffer a call. Only for a weight whose products run
    # one at a time (one stream, one CUDA graph replaying at a time), as in the engine.
    counters: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        """GPU bytes of the codes and the scales: what one product reads of the weight."""
        return self.data.nbytes + self.scales.nbytes


def values_per_word(fmt: str) -> int:
    return 32 // _BITS[fmt]


def block_elements(fmt: str) -> int:
    return BLOCK_WORDS * values_per_word(fmt)


def padded_in_features(in_features: int, fmt: str) -> int:
    block = block_elements(fmt)
    return -(-in_features // block) * block


def packed_words(in_features: int, fmt: str) -> int:
    """Words per row of a packed weight with `in_features` columns."""
    return padded_in_features(in_features, fmt) // values_per_word(fmt)


def scales_shape(out_features: int, in_features: int, fmt: str, group_size: int) -> tuple[int, ...]:
    if fmt == "int4":
        return out_features, padded_in_features(in_features, fmt) // group_size
    return (out_features,)


def check_format(fmt: object, group_size: object) -> None:
    """A format name and, for int4, a group size the kernels take."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"fmt must be one of {QUANT_FORMATS}, got {fmt!r}")
    if fmt == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES} for int4, got {group_size!r}")


def pack_codes(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Unsigned codes [N, K] (any integer dtype, each < 2^bits) as packed words [N, packed_words(K)]."""
    n, k = codes.shape
    bits, per_word = _BITS[fmt], values_per_word(fmt)
    padded = torch.full((n, padded_in_features(k, fmt)), _PAD_CODE[fmt], dtype=torch.int32, device=codes.device)
    padded[:, :k] = codes
    chunks = padded.view(n, -1, per_word, BLOCK_WORDS)  # [row, block, code j, word i]
    words = torch.zeros(n, chunks.shape[1], BLOCK_WORDS, dtype=torch.int32, device=codes.device)
    for j in range(per_word):
        words |= chunks[:, :, j, :] << (bits * j)  # int32 shifts wrap: the top code lands in the sign bit
    return words.view(n, -1)


def quantize_weight(weight: torch.Tensor, fmt: str, group_size: int = 128,
                    scale_dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    """Symmetric round-to-nearest quantization of a float weight [N, K], on its device.

    int4: per group of group_size elements along K, s = amax / 7.5 (rounded up to scale_dtype, so
    no weight is more than s/2 from its code), q = round(w / s) in [-8, 7]. int8: per output
    channel, s = amax / 127, q in [-127, 127]. fp8: per output channel, s = amax / 448, codes =
    float8_e4m3fn(w / s) (round to nearest even)."""
    check_format(fmt, group_size)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a 2-D float tensor, got {weight!r:.80}")
    n, k = weight.shape
    rows = [_quantize_rows(weight[i:i + _ROWS_PER_CHUNK].float(), fmt, group_size, scale_dtype)
            for i in range(0, n, _ROWS_PER_CHUNK)]
    data = torch.cat([r[0] for r in rows]) if len(rows) > 1 else rows[0][0]
    scales = torch.cat([r[1] for r in rows]) if len(rows) > 1 else rows[0][1]
    return QuantizedWeight(data, scales, fmt, group_size if fmt == "int4" else 0, k)


def _quantize_rows(w: torch.Tensor, fmt: str, group_size: int, scale_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    if fmt == "int4":
        padded = torch.zeros(n, padded_in_features(k, fmt), device=w.device)
        padded[:, :k] = w
        groups = padded.view(n, -1, group_size)
        exact = groups.abs().amax(dim=-1) / _INT4_STEPS
        scales = exact.to(scale_dtype)
        scales = torch.where(scales.float() < exact, torch.nextafter(scales, torch.full_like(scales, float("inf"))),
                             scales)
        divisor = torch.where(scales > 0, scales.float(), 1.0)[..., None]
        codes = (groups / divisor).round_().clamp_(-8, 7).add_(8).view(n, -1)[:, :k]
        return pack_codes(codes.to(torch.int32), fmt), scales
    amax = w.abs().amax(dim=1)
    scales = amax / (127.0 if fmt == "int8" else FP8_MAX)
    scaled = w / torch.where(scales > 0, scales, 1.0)[:, None]
    if fmt == "int8":
        codes = scaled.round_().clamp_(-127, 127).add_(128).to(torch.int32)
    else:
        codes = scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    return pack_codes(codes, fmt), scales
