"""quantized_linear's `residual` and `norm`, the quantized model's folded norms: the residual added in the one-row
GEMVs' epilogue (else after the product), the norm taken where x is rounded (quantize_rows: codes of x · g, the
scale times 1 / rms) and by the norm kernel elsewhere; against float64 products of what each path multiplies."""

import importlib

import pytest
import torch
from kernel_checks import DTYPES, assert_close, kernel_module

from fuselab.kernels import quantize_weight, quantized_linear
from fuselab.kernels.reference import rms_norm
from fuselab.kernels.reference_quant import dequantize, quantize_activations

qa = kernel_module("quantized_gemv_a8")
ql = importlib.import_module("fuselab.kernels.quantized_linear")
EPS = 1e-5


def _randn(shape, dtype, device, seed=0, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(device)


def _weight(fmt, n, k, device, seed=0):
    return quantize_weight(_randn((n, k), torch.float32, device, seed) * k**-0.5, fmt, 128)


def _rounded_norm_product(x, g, weight, fmt):
    """float64 y of a path that rounds x: the codes of x · g (in fp32), each row's scale times its 1 / rms."""
    codes, scales = quantize_activations(x.float() * g.float(), fmt)
    rstd = torch.rsqrt(x.double().pow(2).mean(-1) + EPS)
    return (codes.double() * (scales.double() * rstd)[:, None]) @ dequantize(weight).t()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("n, k", [(37, 256), (8, 1024), (5, 2048)])
def test_the_int8_dot_gemv_takes_the_norm_where_it_rounds_x_and_adds_the_residual(device, dtype, fmt, n, k):
    weight = _weight(fmt, n, k, device, n)
    x, g = _randn((1, k), dtype, device, k, 3.0), _randn((k,), dtype, device, 1)
    residual = _randn((1, n), dtype, device, 2, 4.0)
    y = torch.empty(1, n, device=device, dtype=dtype)
    qa.launch_gemv_a8(x, weight, None, y, residual=residual, norm=(g, EPS))
    expected = _rounded_norm_product(x, g, weight, "int8").to(dtype).double() + residual.double()
    assert_close(y, expected, dtype, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_one_row_on_the_fp32_gemv_normalizes_first_and_adds_the_residual_in_its_epilogue(device, dtype, fmt,
                                                                                       monkeypatch):
    if fmt == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    weight = _weight(fmt, 21, 192, device, 4)
    x, g = _randn((1, 192), dtype, device, 5, 2.0), _randn((192,), dtype, device, 6)
    residual = _randn((1, 21), dtype, device, 7)
    assert ql.rounds_x(1, weight) is None  # a small weight: x as it is
    launches = []
    launch = ql._launch_gemv
    monkeypatch.setattr(ql, "_launch_gemv", lambda *a, **kw: launches.append(kw) or launch(*a, **kw))
    y = quantized_linear(x, weight, residual=residual, norm=(g, EPS))
    normalized = rms_norm(x.double(), g.double(), EPS).to(dtype).double()
    expected = (normalized @ dequantize(weight).t()).to(dtype).double() + residual.double()
    assert_close(y, expected, dtype, scale=4.0)
    assert launches[0]["residual"] is not None


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_one_row_of_a_large_weight_goes_through_the_int8_dot_gemv(device, fmt, monkeypatch):
    monkeypatch.setattr(ql, "A8_MIN_WEIGHTS", 1)
    taken = []
    launch = ql.launch_gemv_a8
    monkeypatch.setattr(ql, "launch_gemv_a8", lambda *a, **kw: taken.append(kw) or launch(*a, **kw))
    weight = _weight(fmt, 16, 256, device, 8)
    x, g = _randn((1, 256), torch.float32, device, 9), _randn((256,), torch.float32, device, 10)
    residual = _randn((1, 16), torch.float32, device, 11)
    y = quantized_linear(x, weight, residual=residual, norm=(g, EPS))
    assert_close(y, _rounded_norm_product(x, g, weight, "int8") + residual.double(), torch.float32, scale=4.0)
    assert taken[0]["norm"][0] is g and taken[0]["residual"] is not None


def test_w8a8_rows_take_the_norm_where_they_round_x_and_add_the_residual_after(device):
    weight = _weight("int8", 24, 256, device, 12)
    rows = ql.W8A8_MIN_ROWS + 1
    x = _randn((rows, 256), torch.float32, device, 13) * torch.linspace(0.5, 3.0, rows, device=device)[:, None]
    g, residual = _randn((256,), torch.float32, device, 14), _randn((rows, 24), torch.float32, device, 15)
    assert ql.runs_w8a8(rows, weight)
    y = quantized_linear(x, weight, residual=residual, norm=(g, EPS))
    assert_close(y, _rounded_norm_product(x, g, weight, "int8") + residual.double(), torch.float32, scale=4.0)


def test_a_few_rows_on_the_tensor_core_kernel_normalize_first(device):
    weight = _weight("int4", 32, 256, device, 16)
    x, g = _randn((3, 256), torch.float32, device, 17, 5.0), _randn((256,), torch.float32, device, 18)
    residual = _randn((3, 32), torch.float32, device, 19)
    y = quantized_linear(x, weight, residual=residual, norm=(g, EPS))
    expected = rms_norm(x.double(), g.double(), EPS) @ dequantize(weight).t() + residual.double()
    assert_close(y, expected, torch.float32, scale=4.0)


def test_bad_residual_and_norm_name_the_argument(device):
    weight = _weight("int8", 8, 128, device)
    x = torch.zeros(1, 128, device=device)
    with pytest.raises(ValueError, match="residual must be a \\(1, 8\\)"):
        quantized_linear(x, weight, residual=torch.zeros(1, 9, device=device))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        quantized_linear(x, weight, residual=[0.0] * 8)
    with pytest.raises(TypeError, match="norm must be a \\(weight, eps\\) pair"):
        quantized_linear(x, weight, norm=torch.ones(128, device=device))
    with pytest.raises(ValueError, match="norm weight must be a \\(128,\\)"):
        quantized_linear(x, weight, norm=(torch.ones(64, device=device), EPS))
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        quantized_linear(x, weight, norm=(torch.ones(128, device=device), -1.0))
