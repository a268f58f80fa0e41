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
def gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def gelu_grad(x):
    cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    return cdf + x * pdf


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
