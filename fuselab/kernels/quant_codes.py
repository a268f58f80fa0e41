"""Triton helpers that turn the words of a packed weight (quant_pack) into the values of their codes, in registers.

Shared by the quantized GEMV and dequantize kernels (quantized_linear) and the tensor-core GEMM
(quantized_gemm). Dequantization without int-to-float conversions (a quarter-rate instruction): a
code OR-ed into the mantissa of 2^23 is the float 2^23 + code, and one FFMA gives q exactly (`_codes`).
"""

from __future__ import annotations

import triton
import triton.language as tl

_FORMAT_IDS = {"int4": 0, "int8": 1, "fp8": 2}
MAGIC = 0x4B000000  # fp32 2^23: OR-ed with a code of up to 23 bits it is the float 2^23 + code


@triton.jit
def _high_half(w, FORMAT: tl.constexpr):
    """w's high codes shifted down (logically) to where _codes reads them: one shift a word."""
    SHIFT: tl.constexpr = 16 if FORMAT == 0 else 12
    return (w.to(tl.uint32, bitcast=True) >> SHIFT).to(tl.int32, bitcast=True)


@triton.jit
def _codes(w, hi, magic, j: tl.constexpr, FORMAT: tl.constexpr):
    """Code j of each word as the fp32 value before scaling: q for int4/int8, the e4m3 value for fp8.

    int4/int8: the code, masked where it lies (a mantissa bit of 2^23 or below) and OR-ed with
    magic = 2^23, is the float 2^23 + code · 2^pos; one FFMA by 2^-pos, less 2^-pos · (2^23 +
    zero code · 2^pos), leaves q exactly. One AND-OR and one FFMA a code, no int-to-float
    conversion (a quarter-rate instruction). `magic` is a kernel argument, not a literal, so that
    it stays in one register instead of being re-materialized for every AND-OR."""
    if FORMAT == 2:
        return ((w >> (8 * j)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        # Where code j lies: int4 codes 0-4 where they are in w (bits 0-19), 5-7 in hi = w >> 16
        # (bits 4-15); int8 codes 0-1 in w's low half, 2-3 in hi's high half (hi = w >> 12 for int8,
        # so that no code sits at bit 0 of hi, which the compiler would extract with a shift and a
        # bit-field instruction of its own). Plain constexpr arithmetic: a jit helper returning a
        # tuple of constexprs does not stay constexpr on every Triton release.
        BITS: tl.constexpr = 4 if FORMAT == 0 else 8
        LOW: tl.constexpr = 5 if FORMAT == 0 else 2
        IN_HI: tl.constexpr = j >= LOW
        SHIFT: tl.constexpr = 16 if FORMAT == 0 else 12
        POS: tl.constexpr = BITS * j - SHIFT if IN_HI else BITS * j
        SCALE: tl.constexpr = 1.0 / (1 << POS)
        OFFSET: tl.constexpr = (8388608.0 + (8.0 if FORMAT == 0 else 128.0) * (1 << POS)) * SCALE
        src = hi if IN_HI else w
        v = ((src & (((1 << BITS) - 1) << POS)) | magic).to(tl.float32, bitcast=True)
        return v * SCALE - OFFSET
