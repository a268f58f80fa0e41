"""A GEMM program's rows of an operand, clamped rather than masked.

The quantized GEMMs (quantized_gemm, quantized_gemm_w8a8) clamp the rows of x past M and of W past N
to the last one, so that no load in their K loop is masked (the pipeliner streams every stage), and
store only the rows that exist.
"""

import triton
import triton.language as tl


@triton.jit
def clamped_rows(pid, BLOCK: tl.constexpr, n):
    """(rows pid · BLOCK + [0, BLOCK) with those past n set to n - 1, which of them are below n)."""
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    return tl.minimum(rows, n - 1), rows < n
