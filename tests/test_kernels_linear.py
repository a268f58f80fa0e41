import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import DTYPES, assert_close, kernel_module

from fuselab.kernels import linear

gemv = kernel_module("linear")


def _randn(shape, dtype, device, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _check(x, weight, bias=None):
    got = linear(x, weight, bias)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == expected.shape and got.dtype == x.dtype and got.device == x.device
    # A dot product over K rounds like K sums: fp32 in a different order, half precision at the output.
    assert_close(got, expected, x.dtype, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 3, 1000, 2048, 3000, 4096, 5003, 8192])
@pytest.mark.parametrize("n", [1, 7, 130])
def test_one_row_runs_the_gemv_and_matches_the_reference(device, dtype, k, n, monkeypatch):
    launch, calls = gemv.gemv_launch, []
    monkeypatch.setattr(gemv, "gemv_launch", lambda *a: calls.append(a) or launch(*a))
    x = _randn((1, k), dtype, device, seed=k)
    _check(x, _randn((n, k), dtype, device, seed=n) * k**-0.5)
    assert len(calls) == 1


def test_a_row_of_up_to_4096_is_one_step_longer_rows_step_2048_over_4_rows():
    assert [gemv.gemv_blocks(k) for k in (1, 3, 2048, 2049, 4096, 4097, 14336)] == [
        (2, 1), (2, 4), (2, 2048), (1, 4096), (1, 4096), (4, 2048), (4, 2048)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_and_leading_dims(device, dtype):
    x = _randn((1, 1, 300), dtype, device, 1)
    _check(x, _randn((50, 300), dtype, device, 2) * 0.05, _randn((50,), dtype, device, 3))


def test_non_contiguous_inputs(device):
    x = _randn((600,), torch.float32, device, 1)[::2].unsqueeze(0)  # stride 2 along K
    w = _randn((300, 40), torch.float32, device, 2).t()  # [40, 300], column stride 40
    _check(x, w)
    bias = _randn((80,), torch.float32, device, 3)[::2]  # stride 2
    _check(x, _randn((40, 300), torch.float32, device, 4), bias)


def test_several_rows_and_gradients_go_to_cublas(device, monkeypatch):
    monkeypatch.setattr(gemv, "gemv_launch", lambda *a: pytest.fail("the GEMV ran"))
    w = _randn((20, 30), torch.float32, device, 1)
    _check(_randn((3, 30), torch.float32, device, 2), w)
    x = _randn((1, 30), torch.float32, device, 3).requires_grad_(True)
    linear(x, w).sum().backward()
    assert x.grad is not None and torch.allclose(x.grad, w.sum(0).expand_as(x))


def test_nan_propagates(device):
    x = _randn((1, 64), torch.float32, device, 1)
    x[0, 5] = float("nan")
    assert linear(x, _randn((8, 64), torch.float32, device, 2)).isnan().all()


def test_empty_shapes(device):
    assert linear(torch.zeros(1, 0, device=device), torch.zeros(4, 0, device=device)).tolist() == [[0.0] * 4]
    assert linear(torch.zeros(1, 8, device=device), torch.zeros(0, 8, device=device)).shape == (1, 0)
    assert linear(torch.zeros(0, 8, device=device), torch.zeros(3, 8, device=device)).shape == (0, 3)


def test_bad_inputs(device):
    x, w = torch.zeros(1, 8, device=device), torch.zeros(4, 8, device=device)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        linear([0.0] * 8, w)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        linear(x, w[0])
    with pytest.raises(ValueError, match="x's last dim \\(8\\) must equal weight's in_features \\(5\\)"):
        linear(x, torch.zeros(4, 5, device=device))
    with pytest.raises(TypeError, match="x has dtype torch.float16 but weight has dtype torch.float32"):
        linear(x.half(), w)
    with pytest.raises(TypeError, match="weight must be float32, bfloat16 or float16"):
        linear(x, w.int())
    with pytest.raises(ValueError, match="bias must have shape \\(4,\\)"):
        linear(x, w, torch.zeros(5, device=device))
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        linear(torch.tensor(1.0, device=device), w)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 5000), bias=st.booleans())
def test_any_one_row_shape_matches_reference(n, k, bias):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = _randn((1, k), torch.float32, device, k)
    _check(x, _randn((n, k), torch.float32, device, n) * k**-0.5, _randn((n,), torch.float32, device, 1) if bias else None)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 2048), (2048, 8192), (6144, 4096), (4096, 14336)])
def test_gpu_decode_projections(n, k):
    x = _randn((1, k), torch.bfloat16, "cuda", 1)
    w = _randn((n, k), torch.bfloat16, "cuda", 2) * k**-0.5
    assert gemv.gemv_wins(x, w)
    _check(x, w)
