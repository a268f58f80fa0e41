"""Which precision a matrix multiply ran in, the ceiling it is measured against, and what a lower precision gains.

A float32 GEMM runs on the CUDA cores (the "highest" float32 matmul precision) or, with TF32 allowed
(torch.set_float32_matmul_precision("high"), or torch.backends.cuda.matmul.allow_tf32 = True), on
the tensor cores at TF32. The trace says which when the kernel's name does ("tf32"), or when the
doctor recorded the setting at each step (a FP32_PRECISION_MARK range); otherwise a float32 GEMM
that ran faster than float32 could is taken to have used TF32.

`fuselab probe` measures the bf16 rate only; the other precisions' ceilings are scaled from it by
the ratios of NVIDIA's H100/H200 SXM datasheet (dense: 989 TFLOP/s bf16 and fp16, 495 TF32, 67 FP32
on the CUDA cores, 1979 FP8).
"""

from __future__ import annotations

import re

from fuselab.device import Ceilings

RATE_OVER_BF16 = {"bf16": 1.0, "fp16": 1.0, "fp8": 1979 / 989, "tf32": 495 / 989, "fp32": 67 / 989}
RATIO_SOURCE = "H100/H200 SXM datasheet ratios to the bf16 ceiling"
FP32_PRECISION_MARK = "fuselab.doctor.float32_matmul_precision="
_TYPE_PRECISION = {"c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32",
                   "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8"}
_TF32_KERNEL = re.compile("tf32", re.IGNORECASE)
# A float32 GEMM measured this far above the float32 ceiling cannot have run in float32.
FASTER_THAN_FP32 = 1.25
TF32_FIX = ("allow TF32 for float32 matmuls: torch.set_float32_matmul_precision('high') (or "
            "torch.backends.cuda.matmul.allow_tf32 = True), or run them in bf16 under torch.autocast('cuda', torch.bfloat16)")
BF16_FIX = "run the TF32 matmuls in bf16: torch.autocast('cuda', torch.bfloat16) (or bf16 weights and activations)"


def tf32_allowed(setting: str) -> bool:
    """Whether torch's float32 matmul precision setting ("highest", "high", "medium") lets cuBLAS use TF32."""
    return setting != "highest"


def matmul_precision(input_types: list, kernel_name: str, tf32: bool | None) -> str | None:
    """The precision a matrix op's kernel ran in, from its inputs' dtype; None for dtypes without a tensor-core rate.

    `tf32` is the recorded setting for float32 inputs (None when unknown).
    """
    precision = next((_TYPE_PRECISION[t] for t in input_types if t in _TYPE_PRECISION), None)
    if precision == "fp32" and (tf32 or _TF32_KERNEL.search(kernel_name)):
        return "tf32"
    return precision


def tflops_ceiling(ceilings: Ceilings, precision: str | None) -> float:
    """The dense matrix-multiply ceiling for a precision, TFLOP/s (bf16's for an unknown one)."""
    return ceilings.bf16_tflops * RATE_OVER_BF16.get(precision, 1.0)


def faster_than_fp32(flops: float, dur_us: float, ceilings: Ceilings) -> bool:
    return dur_us > 0 and flops / (dur_us * 1e6) > FASTER_THAN_FP32 * tflops_ceiling(ceilings, "fp32")


def lower_precision_saving(gemm_us: float, precision: str, target: str) -> float:
    """GEMM time saved by running at `target` instead of `precision`, at the same share of each ceiling."""
    return gemm_us * (1 - RATE_OVER_BF16[precision] / RATE_OVER_BF16[target])
