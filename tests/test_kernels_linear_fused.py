"""The GEMV with a prologue or epilogue (rms_norm_linear, silu_and_mul_linear, linear's residual) against
float64 references of the ops it fuses, at odd shapes in every dtype; more rows take the composed ops."""

import pytest
import torch
from kernel_checks import DTYPES, assert_close, kernel_module

from fuselab.kernels import linear, reference, rms_norm_linear, silu_and_mul_linear

gemv = kernel_module("linear")
SHAPES = [(1, 3), (7, 1000), (130, 4096), (6, 5003), (9, 8192)]  # (N, K): one block, several, ragged


def _randn(shape, dtype, device, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _counted(monkeypatch):
    launch, calls = gemv.gemv_launch, []
    monkeypatch.setattr(gemv, "gemv_launch", lambda *a, **kw: calls.append(kw) or launch(*a, **kw))
    return calls


def _rounded(t, dtype):
    """An intermediate as the separate kernel would store it: rounded to the activations' dtype."""
    return t.to(dtype).double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", SHAPES)
def test_rms_norm_linear_one_row_is_one_gemv(device, monkeypatch, dtype, n, k):
    calls = _counted(monkeypatch)
    x, norm_w = _randn((1, k), dtype, device, k), _randn((k,), dtype, device, 1) + 1
    w, b = _randn((n, k), dtype, device, n) * k**-0.5, _randn((n,), dtype, device, 2)
    got = rms_norm_linear(x, norm_w, 1e-5, w, b)
    normed = _rounded(reference.rms_norm(x.double(), norm_w.double(), 1e-5), dtype)
    assert got.shape == (1, n) and got.dtype == dtype
    assert_close(got, reference.linear(normed, w.double(), b.double()), dtype, scale=4.0)
    assert len(calls) == 1 and calls[0]["norm_weight"] is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_silu_and_mul_linear_one_row_is_one_gemv(device, monkeypatch, dtype, n, k, with_residual):
    calls = _counted(monkeypatch)
    x, w = _randn((1, 2 * k), dtype, device, k), _randn((n, k), dtype, device, n) * k**-0.5
    residual = _randn((1, n), dtype, device, 3) if with_residual else None
    got = silu_and_mul_linear(x, w, residual=residual)
    expected = reference.linear(_rounded(reference.silu_and_mul(x.double()), dtype), w.double())
    if with_residual:  # added to the projection rounded, as after a separate kernel
        expected = _rounded(expected, dtype) + residual.double()
    assert got.shape == (1, n) and got.dtype == dtype
    assert_close(got, expected, dtype, scale=4.0)
    assert len(calls) == 1 and calls[0]["gated"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", SHAPES[:3])
def test_linear_adds_the_residual_in_the_gemv(device, monkeypatch, dtype, n, k):
    calls = _counted(monkeypatch)
    x, w, r = _randn((1, 1, k), dtype, device, k), _randn((n, k), dtype, device, n) * k**-0.5, _randn((1, 1, n), dtype, device, 4)
    got = linear(x, w, residual=r)
    assert got.shape == (1, 1, n)
    assert_close(got, _rounded(reference.linear(x.double(), w.double()), dtype) + r.double(), dtype, scale=4.0)
    assert len(calls) == 1 and calls[0]["residual"] is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_several_rows_take_the_composed_ops(device, monkeypatch, dtype):
    monkeypatch.setattr(gemv, "gemv_launch", lambda *a, **kw: pytest.fail("the GEMV ran"))
    x, w, r = _randn((3, 40), dtype, device, 1), _randn((11, 40), dtype, device, 2) * 0.2, _randn((3, 11), dtype, device, 3)
    norm_w, b = _randn((40,), dtype, device, 4), _randn((11,), dtype, device, 5)
    assert_close(linear(x, w, residual=r), reference.linear(x.double(), w.double()) + r.double(), dtype, scale=4.0)
    assert_close(linear(x, w, b, residual=r), reference.linear(x.double(), w.double(), b.double()) + r.double(),
                 dtype, scale=4.0)
    normed = _rounded(reference.rms_norm(x.double(), norm_w.double(), 1e-6), dtype)
    assert_close(rms_norm_linear(x, norm_w, 1e-6, w, b), reference.linear(normed, w.double(), b.double()), dtype,
                 scale=4.0)
    gated = _randn((3, 80), dtype, device, 6)
    expected = reference.linear(_rounded(reference.silu_and_mul(gated.double()), dtype), w.double()) + r.double()
    assert_close(silu_and_mul_linear(gated, w, residual=r), expected, dtype, scale=4.0)


def test_a_float32_norm_weight_with_half_activations(device):
    x, norm_w = _randn((1, 300), torch.bfloat16, device, 1), _randn((300,), torch.float32, device, 2)
    w = _randn((20, 300), torch.bfloat16, device, 3) * 0.05
    expected = reference.linear(_rounded(reference.rms_norm(x.double(), norm_w.double(), 1e-6), torch.bfloat16),
                                w.double())
    assert_close(rms_norm_linear(x, norm_w, 1e-6, w), expected, torch.bfloat16, scale=4.0)


def test_non_contiguous_inputs(device):
    x = _randn((1, 600), torch.float32, device, 1)[:, ::2]  # stride 2 along K
    w = _randn((300, 40), torch.float32, device, 2).t()  # column stride 40: the composed path
    norm_w = _randn((600,), torch.float32, device, 3)[::2]
    expected = reference.rms_norm_linear(x.double(), norm_w.double(), 1e-6, w.double())
    assert_close(rms_norm_linear(x, norm_w, 1e-6, w), expected, torch.float32, scale=4.0)
    w2 = _randn((40, 300), torch.float32, device, 4)
    assert_close(rms_norm_linear(x, norm_w, 1e-6, w2),
                 reference.rms_norm_linear(x.double(), norm_w.double(), 1e-6, w2.double()), torch.float32, scale=4.0)
    gated = _randn((1, 1200), torch.float32, device, 5)[:, ::2]
    assert_close(silu_and_mul_linear(gated, w2), reference.silu_and_mul_linear(gated.double(), w2.double()),
                 torch.float32, scale=4.0)


def test_gradients_take_the_composed_ops(device):
    x = _randn((1, 30), torch.float32, device, 1).requires_grad_(True)
    w, norm_w = _randn((8, 30), torch.float32, device, 2), _randn((30,), torch.float32, device, 3)
    (rms_norm_linear(x, norm_w, 1e-6, w).sum() + silu_and_mul_linear(torch.cat([x, x], -1), w).sum()).backward()
    x2 = x.detach().double().requires_grad_(True)
    (reference.rms_norm_linear(x2, norm_w.double(), 1e-6, w.double()).sum()
     + reference.silu_and_mul_linear(torch.cat([x2, x2], -1), w.double()).sum()).backward()
    assert torch.allclose(x.grad.double(), x2.grad, atol=1e-4)


def test_nan_in_the_row_reaches_every_output(device):
    x = _randn((1, 64), torch.float32, device, 1)
    x[0, 5] = float("nan")
    w = _randn((8, 64), torch.float32, device, 2)
    assert rms_norm_linear(x, torch.ones(64, device=device), 1e-6, w).isnan().all()
    gated = torch.cat([x, torch.ones_like(x)], -1)
    assert silu_and_mul_linear(gated, w).isnan().all()


def test_bad_inputs(device):
    x, w, norm_w = torch.zeros(1, 8, device=device), torch.zeros(4, 8, device=device), torch.ones(8, device=device)
    with pytest.raises(ValueError, match="residual must have the output's shape \\(1, 4\\)"):
        linear(x, w, residual=torch.zeros(1, 8, device=device))
    with pytest.raises(TypeError, match="residual must be torch.float32"):
        linear(x, w, residual=torch.zeros(1, 4, device=device, dtype=torch.float16))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        linear(x, w, residual=[0.0] * 4)
    with pytest.raises(ValueError, match="norm_weight must have shape \\(8,\\)"):
        rms_norm_linear(x, torch.ones(5, device=device), 1e-6, w)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        rms_norm_linear(x, norm_w, -1.0, w)
    with pytest.raises(ValueError, match="x's last dim \\(8\\) must equal weight's in_features \\(5\\)"):
        rms_norm_linear(x, norm_w, 1e-6, torch.zeros(4, 5, device=device))
    with pytest.raises(ValueError, match="twice weight's in_features \\(8\\)"):
        silu_and_mul_linear(x, w)
    with pytest.raises(TypeError, match="must share a dtype"):
        silu_and_mul_linear(torch.zeros(1, 16, device=device, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        silu_and_mul_linear(torch.zeros(1, 16, device=device), w[0])
    with pytest.raises(ValueError, match="residual must have the output's shape"):
        silu_and_mul_linear(torch.zeros(1, 16, device=device), w, residual=torch.zeros(4, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(3072, 2048), (6144, 4096), (2048, 8192), (4096, 14336)])
def test_gpu_decode_shapes(n, k):
    x, w = _randn((1, 2 * k), torch.bfloat16, "cuda", 1), _randn((n, k), torch.bfloat16, "cuda", 2) * k**-0.5
    r, norm_w = _randn((1, n), torch.bfloat16, "cuda", 3), _randn((k,), torch.bfloat16, "cuda", 4)
    assert gemv.gemv_wins(x[:, :k], w)
    expected = _rounded(reference.linear(_rounded(reference.silu_and_mul(x.double()), torch.bfloat16), w.double()),
                        torch.bfloat16) + r.double()
    assert_close(silu_and_mul_linear(x, w, residual=r), expected, torch.bfloat16, scale=4.0)
    normed = _rounded(reference.rms_norm(x[:, :k].double(), norm_w.double(), 1e-5), torch.bfloat16)
    assert_close(rms_norm_linear(x[:, :k], norm_w, 1e-5, w), reference.linear(normed, w.double()), torch.bfloat16,
                 scale=4.0)
