"""Activation functions and their derivatives as Triton device functions, in fp32.

`activate` / `activate_grad` dispatch on a compile-time name, so the branch costs nothing at run time.
"""

import triton
import triton.language as tl

from fuselab.kernels._common.validate import INTERPRETED

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")


# Compiled kernels take the hardware's approximate reciprocal (one special-function instruction,
# relative error ~2^-23) instead of the range-checked sequence `/` compiles to (eight more); the
# interpreter, which has no inline assembly, keeps `1 / x`. (`tl.math.exp2` is already that one
# instruction; `tl.exp` adds a multiply by log2(e) and three more for the denormal range.)
_FAST_MATH = tl.constexpr(not INTERPRETED)


@triton.jit
def _reciprocal_approx(x):
    if _FAST_MATH:
        y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = 1.0 / x
    return y


@triton.jit
def _tanh(x):
    # 2·sigmoid(2x) − 1 via exp: saturates to ±1 instead of overflowing, and needs no libdevice.
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _half_erfc(x, minus_half_x2_log2e):
    """erfc(|x|/√2) / 2 by the Chebyshev fit of Press et al. (relative error under 1.2e-7 for every
    argument, so the negative tail keeps its digits): with t = 2u, u = 1 / (2 + |x|/√2),
    erfc = t·exp(−x²/2 + P(t)); P's coefficients here are theirs times 2^k·log2(e), so the fit runs
    in u and exp2 without extra multiplies. The exact GELU is bound by its instruction count, not by
    its bytes: written with `/` and `tl.exp`, the same fit takes half as many instructions again
    (docs/tuning/common-constants.md)."""
    u = _reciprocal_approx(2.0 + tl.abs(x) * 0.7071067811865476)
    p = -303.64542593966144 + u * 126.21685652580375
    p = 274.87673138349066 + u * p
    p = -104.81620174997849 + u * p
    p = 12.874290612840843 + u * p
    p = -4.300109765421211 + u * p
    p = 1.1170404521800383 + u * p
    p = 2.1588024621137296 + u * p
    p = 2.8854584078150634 + u * p
    p = -1.825748218405333 + u * p
    return u * tl.math.exp2(p + minus_half_x2_log2e)


@triton.jit
def _normal_cdf(x, minus_half_x2_log2e):
    """Φ(x), the standard normal CDF; `minus_half_x2_log2e` is −x²/2 · log2(e), which callers share."""
    h = _half_erfc(x, minus_half_x2_log2e)
    return tl.where(x < 0.0, h, 1.0 - h)


@triton.jit
def gelu(x):
    return x * _normal_cdf(x, -0.7213475204444817 * x * x)


@triton.jit
def gelu_grad(x):
    # Φ(x) + x·φ(x), φ(x) = exp(−x²/2) / √(2π).
    s = -0.7213475204444817 * x * x
    return _normal_cdf(x, s) + x * (0.3989422804014327 * tl.math.exp2(s))


@triton.jit
def gelu_tanh(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + _tanh(inner))


@triton.jit
def gelu_tanh_grad(x):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = _tanh(inner)
    d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner


@triton.jit
def silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def silu_grad(x):
    s = tl.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


@triton.jit
def relu(x):
    # `x < 0` is false for NaN, so NaN passes through as it does in torch.relu.
    return tl.where(x < 0.0, 0.0, x)


@triton.jit
def relu_grad(x):
    # Written as `x <= 0` so that NaN gets slope 1, as torch's threshold backward gives it.
    return tl.where(x <= 0.0, 0.0, 1.0)


@triton.jit
def activate(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "gelu":
        y = gelu(x)
    elif ACTIVATION == "gelu_tanh":
        y = gelu_tanh(x)
    elif ACTIVATION == "silu":
        y = silu(x)
    elif ACTIVATION == "relu":
        y = relu(x)
    else:
        y = x
    return y


@triton.jit
def activate_grad(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "gelu":
        d = gelu_grad(x)
    elif ACTIVATION == "gelu_tanh":
        d = gelu_tanh_grad(x)
    elif ACTIVATION == "silu":
        d = silu_grad(x)
    elif ACTIVATION == "relu":
        d = relu_grad(x)
    else:
        d = x * 0.0 + 1.0
    return d
