"""Place each kernel on the roofline: FLOPs and bytes of the CPU op that launched it, from its recorded shapes.

Matrix ops and attention count 2 FLOPs per multiply-add from their shapes; everything else counts
one FLOP per output element (a reduction: per input element). Bytes are inputs read plus output
written, from shapes and dtypes; the output shape is inferred per op family. A kernel is
compute-bound when its arithmetic intensity (FLOP/byte) is above the ridge point of the ceilings
(TFLOP/s over copy GB/s), memory-bound below it; its % of ceiling is the achieved rate over the
ceiling on that side. A matrix multiply's compute ceiling is its precision's (a float32 GEMM is held
to the float32 or TF32 rate, see precision.py); other ops are held to the bf16 rate.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from fuselab.device import Ceilings
from fuselab.doctor.precision import faster_than_fp32, matmul_precision, tflops_ceiling
from fuselab.doctor.trace import CpuOp, GpuEvent

DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "long": 8, "int": 4,
    "short int": 2, "short": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::complex<float>": 8, "c10::complex<double>": 16,
}
NOT_TENSORS = {"Scalar", "ScalarList", "GenericList", "", "None", "TensorList"}
REDUCTIONS = {
    "sum", "mean", "amax", "amin", "max", "min", "norm", "linalg_vector_norm", "var", "std", "var_mean",
    "std_mean", "argmax", "argmin", "prod", "any", "all", "logsumexp", "count_nonzero",
}
ATTENTION_BHLE = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}
ATTENTION_BLHE = {"_flash_attention_forward", "_efficient_attention_forward"}
# Kernels whose op is unknown (e.g. launched from Triton or a library directly) are classed by name.
_COMPUTE_KERNEL_NAMES = re.compile(r"gemm|xmma|cutlass|wgmma|matmul|flash|fmha|attention|conv", re.IGNORECASE)


@dataclass(frozen=True)
class OpCost:
    flops: float
    bytes: float
    matrix: bool = False  # a matrix multiply or attention: held to its precision's tensor-core ceiling


@dataclass
class KernelCost:
    name: str
    op: str | None
    dur_us: float
    flops: float | None
    bytes: float | None
    bound: str  # "compute" or "memory"
    pct_of_ceiling: float | None  # achieved rate over the ceiling on the bound side; None without an op's shapes
    precision: str | None = None  # of a matrix multiply: "bf16", "fp16", "tf32", "fp32", "fp8"
    tflops_ceiling: float | None = None  # the compute ceiling it was held to


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def _tensors(op: CpuOp) -> list[tuple[list[int], int]]:
    """(shape, bytes per element) of each tensor input; tensor lists are flattened into their tensors."""
    fallback = next((DTYPE_BYTES[t] for t in op.input_types if t in DTYPE_BYTES), 4)
    out = []
    for i, dims in enumerate(op.input_dims):
        kind = op.input_types[i] if i < len(op.input_types) else ""
        if isinstance(dims, list) and dims and all(isinstance(d, list) for d in dims):
            out += [(d, fallback) for d in dims]  # a TensorList: the type string names no dtype
        elif isinstance(dims, list) and kind not in NOT_TENSORS:
            out.append((dims, DTYPE_BYTES.get(kind, fallback)))
    return out


def _matmul_shape(a: list[int], b: list[int]) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of torch.matmul(a, b) with broadcasting, or None for shapes it would reject."""
    a2 = [1] + a if len(a) == 1 else a
    b2 = b + [1] if len(b) == 1 else b
    if len(a2) < 2 or len(b2) < 2 or a2[-1] != b2[-2]:
        return None
    batch_a, batch_b = a2[:-2], b2[:-2]
    width = max(len(batch_a), len(batch_b))
    batch_a = [1] * (width - len(batch_a)) + batch_a
    batch_b = [1] * (width - len(batch_b)) + batch_b
    return _numel([max(x, y) for x, y in zip(batch_a, batch_b)]), a2[-2], a2[-1], b2[-1]


def _matrix_cost(name: str, tensors: list[tuple[list[int], int]]) -> OpCost | None:
    shapes = [s for s, _ in tensors]
    elem = tensors[0][1] if tensors else 2
    read = sum(_numel(s) * b for s, b in tensors)
    mkn = None
    if name in ("mm", "matmul", "bmm") and len(shapes) >= 2:
        mkn = _matmul_shape(shapes[0], shapes[1])
    elif name in ("addmm", "baddbmm") and len(shapes) >= 3:
        mkn = _matmul_shape(shapes[1], shapes[2])
        elem = tensors[1][1]
    elif name == "linear" and len(shapes) >= 2 and len(shapes[1]) == 2 and shapes[0]:
        x, w = shapes[0], shapes[1]
        if x[-1] == w[1]:
            mkn = (1, _numel(x[:-1]), w[1], w[0])
    elif name in ATTENTION_BHLE | ATTENTION_BLHE and len(shapes) >= 3 and all(len(s) == 4 for s in shapes[:3]):
        q, k, v = shapes[:3]
        if name in ATTENTION_BLHE:  # (batch, length, heads, head dim)
            q, k, v = ([s[0], s[2], s[1], s[3]] for s in (q, k, v))
        b, h, length, e = q
        s_len, ev = k[2], v[3]
        flops = 2.0 * b * h * length * s_len * (e + ev)  # Q K^T, then P V
        return OpCost(flops, read + b * h * length * ev * tensors[0][1], matrix=True)
    if mkn is None:
        return None
    batch, m, k, n = mkn
    return OpCost(2.0 * batch * m * k * n, read + batch * m * n * elem, matrix=True)


def op_cost(op: CpuOp) -> OpCost | None:
    """FLOPs and bytes of one CPU op from its recorded shapes; None when it recorded no tensor shapes."""
    name = op.name.removeprefix("aten::")
    tensors = _tensors(op)
    if not tensors:
        return None
    matrix = _matrix_cost(name, tensors)
    if matrix is not None:
        return matrix
    read = sum(_numel(s) * b for s, b in tensors)
    largest = max(_numel(s) for s, _ in tensors)
    if name in REDUCTIONS:
        return OpCost(float(largest), float(read))  # the reduced output is small next to the input
    if name == "embedding" and len(tensors) >= 2:
        (weight, wbytes), (indices, _) = tensors[0], tensors[1]
        out = _numel(indices) * (weight[-1] if weight else 1) * wbytes
        return OpCost(0.0, float(_numel(indices) * 8 + 2 * out))
    if name == "cat":
        return OpCost(0.0, 2.0 * read)
    if name == "copy_":
        return OpCost(0.0, float(read))  # reads src, writes self: both are inputs
    if name.endswith("_") and not name.endswith("__"):
        return OpCost(float(largest), float(read + _numel(tensors[0][0]) * tensors[0][1]))  # in place: writes self
    # Elementwise and everything else: the output has the broadcast (largest) shape and the first dtype.
    return OpCost(float(largest), float(read + largest * tensors[0][1]))


def _place(k: GpuEvent, op: CpuOp, cost: OpCost, share: float, ceilings: Ceilings, tf32: bool | None) -> KernelCost:
    """One kernel's share of its op's cost on the roofline of its precision."""
    flops, nbytes = cost.flops * share, cost.bytes * share
    precision = matmul_precision(op.input_types, k.name, tf32) if cost.matrix else None
    if precision == "fp32" and tf32 is None and faster_than_fp32(flops, k.dur, ceilings):
        precision = "tf32"  # faster than float32 can run: cuBLAS used the tensor cores
    tflops = tflops_ceiling(ceilings, precision)
    ridge = tflops * 1e12 / (ceilings.copy_bandwidth_gbs * 1e9)
    compute = nbytes > 0 and flops / nbytes >= ridge
    if k.dur <= 0:
        pct = None
    elif compute:
        pct = 100 * flops / (tflops * 1e6) / k.dur
    else:
        pct = 100 * ceilings.memory_time_us(nbytes) / k.dur
    return KernelCost(k.name, op.name, k.dur, flops, nbytes, "compute" if compute else "memory", pct,
                      precision, tflops if cost.matrix else None)


def kernel_costs(kernels: list[GpuEvent], op_of: dict[int, CpuOp | None], ceilings: Ceilings,
                 tf32: list[bool | None] | None = None) -> list[KernelCost]:
    """Roofline place of each GPU event; `op_of` maps an event's index in `kernels` to its launching op,
    `tf32` (aligned with `kernels`) says whether TF32 was allowed when it was launched, None where unknown.

    An op that launched several kernels has its FLOPs and bytes shared among them by duration.
    """
    op_time: dict[int, float] = {}
    for i, k in enumerate(kernels):
        op = op_of.get(i)
        if op is not None:
            op_time[id(op)] = op_time.get(id(op), 0.0) + k.dur
    costs = []
    # A loop launches the same op with the same shapes over and over: cost each signature once.
    cache: dict[tuple[str, str, str], OpCost | None] = {}
    for i, k in enumerate(kernels):
        op = op_of.get(i)
        cost = None
        if op is not None and k.kind == "kernel":
            signature = (op.name, repr(op.input_dims), repr(op.input_types))
            if signature not in cache:
                cache[signature] = op_cost(op)
            cost = cache[signature]
        if cost is None:
            bound = "compute" if k.kind == "kernel" and _COMPUTE_KERNEL_NAMES.search(k.name) else "memory"
            costs.append(KernelCost(k.name, op.name if op else None, k.dur, None, None, bound, None))
            continue
        share = k.dur / op_time[id(op)] if op_time[id(op)] > 0 else 1.0
        costs.append(_place(k, op, cost, share, ceilings, tf32[i] if tf32 else None))
    return costs
