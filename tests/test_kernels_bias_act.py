import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import DTYPES, assert_close, leaf

from fuselab.kernels import bias_act, reference

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")


def _randn(shape, dtype, device, seed=0):
    return (2 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 3, 1000, 5003])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_matches_reference(device, dtype, width, activation):
    x, bias = _randn((2, width), dtype, device, 0), _randn((width,), dtype, device, 1)
    expected = reference.bias_act(x.double(), bias.double(), activation)
    assert_close(bias_act(x, bias, activation), expected, dtype)


def test_exact_gelu_keeps_relative_accuracy_across_its_range_and_in_the_negative_tail(device):
    """The erfc fit behind GELU: relative, not only absolute, accuracy down to gelu(-12) ~ 1e-32 (the
    fp32 rounding of x² bounds it there, to ~1e-5). The values are one row: the activation is
    elementwise, and a row of 4805 columns is a few programs where a column of 4805 rows is thousands
    (each a slow step in the interpreter)."""
    x = torch.cat([torch.linspace(-12, 12, 4801), torch.tensor([0.0, -0.0, 1e-30, -1e-30])]).to(device)[None, :]
    zero = torch.zeros(x.shape[1], device=device)
    # Written with erfc: torch's own float64 GELU computes 1 + erf and cancels to 0 below x = -8.5.
    xd = x.double()
    phi = 0.5 * torch.special.erfc(-xd / 2**0.5)
    torch.testing.assert_close(bias_act(x, zero, "gelu").double(), xd * phi, rtol=3e-5, atol=0)
    xk = x.clone().requires_grad_(True)
    bias_act(xk, zero, "gelu").sum().backward()
    grad = phi + xd * torch.exp(-0.5 * xd * xd) / (2 * torch.pi) ** 0.5
    torch.testing.assert_close(xk.grad.double(), grad, rtol=3e-5, atol=1e-7)  # grad crosses 0 at x = -0.75


def test_exact_gelu_at_infinities_and_nan_matches_the_float64_reference(device):
    x = torch.tensor([[float("inf")], [float("-inf")], [float("nan")]], device=device)
    zero = torch.zeros(1, device=device)
    expected = reference.bias_act(x.double(), zero.double(), "gelu")  # inf, nan (-inf · 0), nan
    torch.testing.assert_close(bias_act(x, zero, "gelu").double(), expected, equal_nan=True)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_backward_matches_autograd_of_reference(device, activation):
    x, bias, dy = _randn((3, 2, 100), torch.float32, device, 0), _randn((100,), torch.float32, device, 1), _randn(
        (3, 2, 100), torch.float32, device, 2
    )
    xk, bk = x.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    bias_act(xk, bk, activation).backward(dy)
    xr, br = leaf(x), leaf(bias)
    reference.bias_act(xr, br, activation).backward(dy.double())
    assert_close(xk.grad, xr.grad, torch.float32)
    assert_close(bk.grad, br.grad, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_sums_dbias_over_bands_of_rows_and_blocks_of_columns(device, dtype):
    # 21 rows: bands of the backward's rows per program with a partial last one; 5003 columns: two
    # blocks of columns, the second partial.
    x, dy = _randn((3, 7, 5003), dtype, device, 0), _randn((3, 7, 5003), dtype, device, 2)
    bias = _randn((5003,), dtype, device, 1)
    xk, bk = x.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    bias_act(xk, bk, "gelu").backward(dy)
    xr, br = leaf(x), leaf(bias)
    reference.bias_act(xr, br, "gelu").backward(dy.double())
    assert_close(xk.grad, xr.grad, dtype)
    assert_close(bk.grad, br.grad, dtype, scale=4)


def test_half_input_with_fp32_bias(device):
    x, bias = _randn((4, 64), torch.bfloat16, device), _randn((64,), torch.float32, device, 1)
    out = bias_act(x, bias, "silu")
    assert out.dtype == torch.bfloat16
    assert_close(out, reference.bias_act(x.double(), bias.double(), "silu"), torch.bfloat16)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_nan_propagates(device, activation):
    x, bias = _randn((2, 8), torch.float32, device), torch.zeros(8, device=device)
    x[0, 3] = float("nan")
    out = bias_act(x, bias, activation)
    assert torch.isnan(out[0, 3]) and torch.isnan(out).sum() == 1


def test_non_contiguous_and_empty(device):
    x = _randn((40, 6), torch.float32, device).t()
    bias = _randn((40,), torch.float32, device, 1)
    assert_close(bias_act(x, bias), reference.bias_act(x.double(), bias.double()), torch.float32)
    assert bias_act(torch.empty(0, 4, device=device), torch.zeros(4, device=device)).shape == (0, 4)


def test_bad_inputs_raise_naming_the_argument(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="activation must be one of"):
        bias_act(x, torch.zeros(8, device=device), "tanh")
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        bias_act(x, torch.zeros(2, 8, device=device))
    with pytest.raises(TypeError, match="bias must be float32"):
        bias_act(x, torch.zeros(8, device=device, dtype=torch.int64))


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 4), width=st.integers(1, 3000), activation=st.sampled_from(ACTIVATIONS))
def test_any_shape_matches_reference(rows, width, activation):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, bias = _randn((rows, width), torch.float32, device, 0), _randn((width,), torch.float32, device, 1)
    expected = reference.bias_act(x.double(), bias.double(), activation)
    assert_close(bias_act(x, bias, activation), expected, torch.float32)
