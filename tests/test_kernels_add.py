import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import DTYPES, assert_close

from fuselab.kernels import add, reference


def _randn(shape, dtype, device, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3,), (1000,), (5003,), (3, 4097), (2, 3, 5)])
def test_matches_reference(device, dtype, shape):
    a, b = _randn(shape, dtype, device, 0), _randn(shape, dtype, device, 1)
    out = add(a, b)
    assert out.shape == a.shape and out.dtype == dtype
    assert_close(out, reference.add(a.double(), b.double()), dtype)


def test_backward_passes_the_gradient_to_both(device):
    a, b = (_randn((5,), torch.float32, device, s).requires_grad_(True) for s in (0, 1))
    dy = _randn((5,), torch.float32, device, 2)
    add(a, b).backward(dy)
    torch.testing.assert_close(a.grad, dy)
    torch.testing.assert_close(b.grad, dy)


def test_non_contiguous_inputs(device):
    a, b = _randn((7, 5), torch.float32, device, 0).t(), _randn((5, 7), torch.float32, device, 1)
    assert_close(add(a, b), a.double() + b.double(), torch.float32)


def test_empty_and_special_values(device):
    assert add(torch.empty(0, 3, device=device), torch.empty(0, 3, device=device)).shape == (0, 3)
    a = torch.tensor([float("nan"), float("inf"), float("inf"), 1.0], device=device)
    b = torch.tensor([1.0, 1.0, float("-inf"), 2.0], device=device)
    torch.testing.assert_close(add(a, b), a + b, equal_nan=True)


def test_bad_inputs_raise_naming_the_argument(device):
    a = torch.randn(4, device=device)
    with pytest.raises(ValueError, match="b has shape"):
        add(a, torch.randn(3, device=device))
    with pytest.raises(TypeError, match="b has dtype"):
        add(a, a.half())
    with pytest.raises(TypeError, match="a must be float32"):
        add(a.int(), a.int())
    with pytest.raises(TypeError, match="b must be a torch.Tensor"):
        add(a, 1.0)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(0, 20000))
def test_any_length_matches_reference(n):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a, b = _randn((n,), torch.float32, device, 0), _randn((n,), torch.float32, device, 1)
    torch.testing.assert_close(add(a, b), a + b)
