"""Activation functions and their derivatives as Triton device functions, in fp32.

`activate` / `activate_grad` dispatch on a compile-time name, so the branch costs nothing at run time.
"""

import triton
import triton.language as tl

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")


@triton.jit
def _tanh(x):
    # 2·sigmoid(2x) − 1 via exp: saturates to ±1 instead of overflowing, and needs no libdevice.
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _two_cdf(x):
    """2·Φ(x) = 1 + erf(x/√2), from erfc(|x|/√2) by the Chebyshev fit of Press et al. (relative error
    under 1.2e-7 for every argument, so the negative tail keeps its digits). One fast division, nine
    multiply-adds and one exp2 per element: libdevice's erf costs about twice the instructions, and
    they, not the bytes, bounded the exact GELU at large sizes (61% of the copy bandwidth)."""
    z = tl.abs(x) * 0.7071067811865476
    t = 1.0 / (1.0 + 0.5 * z)
    p = -0.82215223 + t * 0.17087277
    p = 1.48851587 + t * p
    p = -1.13520398 + t * p
    p = 0.27886807 + t * p
    p = -0.18628806 + t * p
    p = 0.09678418 + t * p
    p = 0.37409196 + t * p
    p = 1.00002368 + t * p
    p = -1.26551223 + t * p
    erfc = t * tl.exp(p - z * z)
    return tl.where(x < 0.0, erfc, 2.0 - erfc)


@triton.jit
def gelu(x):
    return 0.5 * x * _two_cdf(x)


@triton.jit
def gelu_grad(x):
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    return 0.5 * _two_cdf(x) + x * pdf


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
