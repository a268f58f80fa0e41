"""Triton helpers that turn the words of a packed weight (quant_pack) into the values of their codes, in registers.

Shared by the quantized GEMV and dequantize kernels (quantized_linear) and the tensor-core GEMM
(quantized_gemm). Dequantization without int-to-float conversions (a quarter-rate instruction): a
code OR-ed into the mantissa of 2^23 is the float 2^23 + code, and one FFMA gives q exactly (`_codes`);
for bf16 tensor-core operands, two codes at a time in the halves of a bf16x2 register (`_int4_bf16x2`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselab.kernels._common.validate import INTERPRETED

_FORMAT_IDS = {"int4": 0, "int8": 1, "fp8": 2}
MAGIC = 0x4B000000  # fp32 2^23: OR-ed with a code of up to 23 bits it is the float 2^23 + code
# The interpreter has no inline assembly: there `_int4_bf16x2` computes the same values in fp32.
_PTX = tl.constexpr(not INTERPRETED)

# Codes 0-7 of two int4 words w0, w1 ($8, $9), each times its scale ($10-$17: bf16 pairs), as bf16
# pairs $0-$7 = (q·s of w0, q·s of w1): the words' low halves (codes 0-3) or high halves (4-7) side
# by side (PRMT); a code shifted to bit 0 of each half and OR-ed into the mantissa of bf16 128 is
# 128 + code (LOP3); less 136 it is q exactly; times the scale, q·s rounded once (+ -0.0 keeps it).
_INT4_BF16X2_ASM = tl.constexpr("""{
.reg .b32 wlo, whi, t, one, bias, nz;
mov.b32 one, 0x3F803F80;
mov.b32 bias, 0xC308C308;
mov.b32 nz, 0x80008000;
prmt.b32 wlo, $8, $9, 0x5410;
prmt.b32 whi, $8, $9, 0x7632;
lop3.b32 t, wlo, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 t, t, one, bias; fma.rn.bf16x2 $0, t, $10, nz;
shr.b32 t, wlo, 4; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 t, t, one, bias; fma.rn.bf16x2 $1, t, $11, nz;
shr.b32 t, wlo, 8; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 t, t, one, bias; fma.rn.bf16x2 $2, t, $12, nz;
shr.b32 t, wlo, 12; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 t, t, one, bias; fma.rn.bf16x2 $3, t, $13, nz;
lop3.b32 t, whi, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 t, t, one, bias; fma.rn.bf16x2 $4, t, $14, nz;
shr.b32 t, whi, 4; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 t, t, one, bias; fma.rn.bf16x2 $5, t, $15, nz;
shr.b32 t, whi, 8; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 t, t, one, bias; fma.rn.bf16x2 $6, t, $16, nz;
shr.b32 t, whi, 12; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; fma.rn.bf16x2 t, t, one, bias; fma.rn.bf16x2 $7, t, $17, nz;
}""")

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


@triton.jit
def _int4_bf16x2(w, magic, s0, s1, s2, s3, s4, s5, s6, s7):
    """Codes 0-7 of int4 words w, each times its scale s_j (bf16, broadcast to w's shape), as 8 bf16
    tensors: q · s rounded once, as `_codes(w, hi, magic, j, 0) * s_j` in fp32 rounded to bf16 is.

    Compiled: two words at a time into bf16x2 registers (_INT4_BF16X2_ASM), 2 instructions a value
    (PRMT, shift, LOP3 a pair of codes, two bf16x2 FMAs) where the fp32 path takes 3.5 (LOP3, FFMA,
    FMUL, half a pack to bf16x2). Which two words make a pair is the compiler's choice; every value
    depends on its own word only, so any pairing gives the same values, and a layout whose two
    registers in a row are neighbouring words of a row gives the tensor-core operand's own pairs."""
    if _PTX:
        return tl.inline_asm_elementwise(
            _INT4_BF16X2_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r", [w, s0, s1, s2, s3, s4, s5, s6, s7],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        hi = _high_half(w, 0)
        return ((_codes(w, hi, magic, 0, 0) * s0.to(tl.float32)).to(tl.bfloat16),
                (_codes(w, hi, magic, 1, 0) * s1.to(tl.float32)).to(tl.bfloat16),
                (_codes(w, hi, magic, 2, 0) * s2.to(tl.float32)).to(tl.bfloat16),
                (_codes(w, hi, magic, 3, 0) * s3.to(tl.float32)).to(tl.bfloat16),
                (_codes(w, hi, magic, 4, 0) * s4.to(tl.float32)).to(tl.bfloat16),
                (_codes(w, hi, magic, 5, 0) * s5.to(tl.float32)).to(tl.bfloat16),
                (_codes(w, hi, magic, 6, 0) * s6.to(tl.float32)).to(tl.bfloat16),
                (_codes(w, hi, magic, 7, 0) * s7.to(tl.float32)).to(tl.bfloat16))
