import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import DTYPES, assert_close, leaf

from fuselab.kernels import reference, silu_and_mul, swiglu

WIDTHS = (1, 3, 1000, 5003)


def _randn(shape, dtype, device, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_swiglu_matches_reference(device, dtype, width):
    gate, up = _randn((2, width), dtype, device, 0), _randn((2, width), dtype, device, 1)
    assert_close(swiglu(gate, up), reference.swiglu(gate.double(), up.double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("half", WIDTHS)
def test_silu_and_mul_matches_reference(device, dtype, half):
    x = _randn((2, 2 * half), dtype, device)
    out = silu_and_mul(x)
    assert out.shape == (2, half) and out.dtype == dtype
    assert_close(out, reference.silu_and_mul(x.double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_backward_matches_autograd_of_reference(device, dtype):
    gate, up, dy = (_randn((3, 1000), dtype, device, s) for s in range(3))
    gk, uk = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    swiglu(gk, uk).backward(dy)
    gr, ur = leaf(gate), leaf(up)
    reference.swiglu(gr, ur).backward(dy.double())
    assert_close(gk.grad, gr.grad, dtype)
    assert_close(uk.grad, ur.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_backward_matches_autograd_of_reference(device, dtype):
    x, dy = _randn((3, 2, 2 * 501), dtype, device, 0), _randn((3, 2, 501), dtype, device, 1)
    xk = x.clone().requires_grad_(True)
    silu_and_mul(xk).backward(dy)
    xr = leaf(x)
    reference.silu_and_mul(xr).backward(dy.double())
    assert_close(xk.grad, xr.grad, dtype)


def test_non_contiguous_inputs(device):
    x = _randn((40, 6), torch.float32, device).t()  # (6, 40), strided
    assert_close(silu_and_mul(x), reference.silu_and_mul(x.double()), torch.float32)
    assert_close(swiglu(x, x), reference.swiglu(x.double(), x.double()), torch.float32)


def test_gradient_of_a_broadcast_output_gradient(device):
    # `.sum().backward()` hands backward an expanded (stride-0) gradient.
    x = _randn((2, 8), torch.float32, device).requires_grad_(True)
    silu_and_mul(x).sum().backward()
    xr = leaf(x)
    reference.silu_and_mul(xr).sum().backward()
    assert_close(x.grad, xr.grad, torch.float32)


def test_empty_inputs(device):
    assert swiglu(torch.empty(0, 4, device=device), torch.empty(0, 4, device=device)).shape == (0, 4)
    assert silu_and_mul(torch.empty(3, 0, device=device)).shape == (3, 0)
    x = torch.empty(0, 8, device=device, requires_grad=True)
    silu_and_mul(x).sum().backward()
    assert x.grad.shape == (0, 8)


def test_nan_propagates_elementwise(device):
    gate, up = _randn((2, 8), torch.float32, device, 0), _randn((2, 8), torch.float32, device, 1)
    gate[0, 1] = float("nan")
    up[1, 2] = float("inf")
    assert_close(swiglu(gate, up), reference.swiglu(gate.double(), up.double()), torch.float32)


def test_bad_inputs_raise_naming_the_argument(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.randn(2, 7, device=device))
    with pytest.raises(TypeError, match="x must be float32"):
        silu_and_mul(x.long())
    with pytest.raises(ValueError, match="up has shape"):
        swiglu(x, torch.randn(2, 4, device=device))
    with pytest.raises(TypeError, match="up has dtype"):
        swiglu(x, x.half())
    with pytest.raises(TypeError, match="up must be a torch.Tensor"):
        swiglu(x, 1.0)
    with pytest.raises(ValueError, match="gate must have at least one dimension"):
        swiglu(torch.tensor(1.0, device=device), torch.tensor(1.0, device=device))


@settings(max_examples=8, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3))
def test_any_shape_matches_reference(shape):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = _randn((*shape[:-1], 2 * shape[-1]), torch.float32, device)
    assert_close(silu_and_mul(x), reference.silu_and_mul(x.double()), torch.float32)
