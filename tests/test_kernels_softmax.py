import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import DTYPES, assert_close, leaf, lower_block_cap

from fuselab.kernels import reference, softmax

WIDTHS = (1, 3, 1000, 5003)


def _randn(shape, dtype, device, seed=0, scale=3.0):
    return (scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("looped", [False, True])
def test_forward_matches_reference(device, monkeypatch, dtype, width, looped):
    if looped:
        lower_block_cap(monkeypatch, "softmax", 256)
    x = _randn((2, width), dtype, device)
    assert_close(softmax(x), reference.softmax(x.double()), dtype)


def test_large_logits_do_not_overflow(device, monkeypatch):
    # exp(1000) overflows fp32; subtracting the maximum keeps every term in range. The largest value
    # sits in the last block, so the looped pass must rescale its running sum.
    x = torch.linspace(0, 1000, 1000, device=device).reshape(1, -1)
    expected = reference.softmax(x.double())
    assert_close(softmax(x), expected, torch.float32)
    lower_block_cap(monkeypatch, "softmax", 128)
    assert_close(softmax(x), expected, torch.float32)


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_other_dims(device, dim):
    x = _randn((5, 6, 7), torch.float32, device)
    assert_close(softmax(x, dim=dim), reference.softmax(x.double(), dim=dim), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("looped", [False, True])
def test_backward_matches_autograd_of_reference(device, monkeypatch, dtype, looped):
    if looped:
        lower_block_cap(monkeypatch, "softmax", 128)
    x, dy = _randn((3, 500), dtype, device, 0), _randn((3, 500), dtype, device, 1, scale=1.0)
    xk = x.clone().requires_grad_(True)
    softmax(xk).backward(dy)
    xr = leaf(x)
    reference.softmax(xr).backward(dy.double())
    assert_close(xk.grad, xr.grad, dtype)


def test_backward_along_another_dim(device):
    x = _randn((4, 6), torch.float32, device).requires_grad_(True)
    softmax(x, dim=0).pow(2).sum().backward()
    xr = leaf(x)
    reference.softmax(xr, dim=0).pow(2).sum().backward()
    assert_close(x.grad, xr.grad, torch.float32)


@pytest.mark.parametrize("looped", [False, True])
def test_special_values_match_reference(device, monkeypatch, looped):
    if looped:
        lower_block_cap(monkeypatch, "softmax", 2)
    inf, nan = float("inf"), float("nan")
    x = torch.tensor(
        [[-inf, -inf, 0.0, 1.0], [-inf, -inf, -inf, -inf], [0.0, nan, 1.0, 2.0], [0.0, inf, 1.0, 2.0]], device=device
    )
    assert_close(softmax(x), torch.softmax(x.double(), dim=-1), torch.float32)


def test_non_contiguous_and_empty(device):
    x = _randn((40, 6), torch.float32, device).t()
    assert_close(softmax(x), reference.softmax(x.double()), torch.float32)
    assert softmax(torch.empty(0, 5, device=device)).shape == (0, 5)
    assert softmax(torch.empty(4, 0, device=device)).shape == (4, 0)


def test_bad_inputs_raise_naming_the_argument(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="dim must be"):
        softmax(x, dim=2)
    with pytest.raises(TypeError, match="x must be float32"):
        softmax(x.long())
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        softmax(torch.tensor(1.0, device=device))


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 4), width=st.integers(1, 600), cap=st.sampled_from([64, 1024]))
def test_any_shape_matches_reference(rows, width, cap):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.MonkeyPatch.context() as mp:
        lower_block_cap(mp, "softmax", cap)
        x = _randn((rows, width), torch.float32, device, seed=width)
        assert_close(softmax(x), reference.softmax(x.double()), torch.float32)
