"""The ops a decode row runs once the norms' weights are folded into the projections after them:
`linear(..., residual=)` (the residual add in the GEMV's epilogue), `rms_linear` (the norm's 1 / rms taken
in the GEMV's pass over x), `rms_silu_and_mul` (taken in the SwiGLU) and `rms_linear_swiglu` (the norm, the
gate/up projection over (gate, up) row pairs and the SwiGLU in one GEMV), against float64 references."""

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPES, assert_close, kernel_module

from fuselab.kernels import (
    linear,
    reference,
    rms_linear,
    rms_linear_swiglu,
    rms_norm,
    rms_silu_and_mul,
    silu_and_mul,
)

gemv = kernel_module("linear")


def _randn(shape, dtype, device, seed=0, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(device)


def _counting_gemv(monkeypatch):
    launch, calls = gemv.gemv_launch, []
    monkeypatch.setattr(gemv, "gemv_launch", lambda *a, **kw: calls.append(kw) or launch(*a, **kw))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(1, 3), (7, 1000), (130, 2048), (5, 4097), (33, 5003)])
def test_rms_linear_at_one_row_is_the_gemv_and_matches_the_norm_then_the_projection(device, dtype, n, k,
                                                                                    monkeypatch):
    calls = _counting_gemv(monkeypatch)
    x = _randn((1, k), dtype, device, k, scale=3.0)  # not unit scale: the factor must matter
    w = _randn((n, k), dtype, device, n, scale=k**-0.5)
    got = rms_linear(x, w, 1e-5)
    expected = reference.rms_linear(x.double(), w.double(), 1e-5)
    assert got.shape == (1, n) and got.dtype == dtype
    assert_close(got, expected, dtype, scale=4.0)
    assert [c.get("rms_eps") for c in calls] == [1e-5]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_linear_with_a_bias_and_leading_dims(device, dtype):
    x, w, b = _randn((1, 1, 300), dtype, device, 1, 2.0), _randn((50, 300), dtype, device, 2, 0.05), \
        _randn((50,), dtype, device, 3)
    expected = reference.rms_linear(x.double(), w.double(), 1e-6, b.double())
    assert_close(rms_linear(x, w, 1e-6, b), expected, dtype, scale=4.0)


def test_rms_linear_equals_a_norm_whose_weight_is_folded_into_the_projection(device):
    x = _randn((1, 96), torch.float32, device, 1)
    g, w = _randn((96,), torch.float32, device, 2), _randn((40, 96), torch.float32, device, 3)
    unfolded = F.linear(reference.rms_norm(x.double(), g.double(), 1e-5), w.double())
    assert_close(rms_linear(x, w * g, 1e-5), unfolded, torch.float32, scale=4.0)


def test_rms_linear_over_several_rows_normalizes_each(device, monkeypatch):
    monkeypatch.setattr(gemv, "gemv_launch", lambda *a, **kw: pytest.fail("the GEMV ran"))
    x = _randn((3, 64), torch.float32, device, 1) * torch.tensor([[1.0], [10.0], [0.1]], device=device)
    w = _randn((8, 64), torch.float32, device, 2)
    expected = F.linear(rms_norm(x, torch.ones(64, device=device), 1e-6).double(), w.double())
    assert_close(rms_linear(x, w), expected, torch.float32, scale=4.0)


def test_rms_linear_of_a_zero_row_is_zero_not_nan(device):
    y = rms_linear(torch.zeros(1, 64, device=device), _randn((8, 64), torch.float32, device, 1), 1e-6)
    assert y.tolist() == [[0.0] * 8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(1, 3), (130, 2048), (5, 4097), (33, 5003), (7, 8192)])
def test_rms_linear_with_the_norms_weight_apart_matches_the_unfolded_norm(device, dtype, n, k, monkeypatch):
    # An lm_head tied to the embedding table: the final norm's g cannot go into the shared weight.
    calls = _counting_gemv(monkeypatch)
    x, g = _randn((1, k), dtype, device, k, scale=3.0), _randn((k,), dtype, device, k + 1)
    w = _randn((n, k), dtype, device, n, scale=k**-0.5)
    expected = reference.rms_linear(x.double(), w.double(), 1e-5, None, g.double())
    assert_close(rms_linear(x, w, 1e-5, norm_weight=g), expected, dtype, scale=4.0)
    out = torch.full((1, n), float("nan"), dtype=dtype, device=device)
    assert rms_linear(x, w, 1e-5, norm_weight=g, out=out) is out
    assert_close(out, expected, dtype, scale=4.0)
    assert [c.get("norm_weight") is not None for c in calls] == [True, True]


def test_rms_linear_at_one_row_runs_the_gemv_even_where_cublas_would_fill_the_gpu(device, monkeypatch):
    # The logits projection (128256 rows): the norm the GEMV takes is worth more than cuBLAS's reading.
    calls = _counting_gemv(monkeypatch)
    monkeypatch.setattr(gemv, "_few_rows_for_cublas", lambda n, device: False)
    x, w = _randn((1, 64), torch.float32, device, 1), _randn((32, 64), torch.float32, device, 2)
    assert_close(rms_linear(x, w), reference.rms_linear(x.double(), w.double()), torch.float32, scale=4.0)
    assert len(calls) == 1


def test_rms_linear_over_several_rows_with_the_norms_weight_and_out(device, monkeypatch):
    monkeypatch.setattr(gemv, "gemv_launch", lambda *a, **kw: pytest.fail("the GEMV ran"))
    x = _randn((3, 64), torch.float32, device, 1) * torch.tensor([[1.0], [10.0], [0.1]], device=device)
    g, w = _randn((64,), torch.float32, device, 2), _randn((8, 64), torch.float32, device, 3)
    expected = F.linear(reference.rms_norm(x.double(), g.double(), 1e-6), w.double())
    out = torch.empty(3, 8, device=device)
    assert rms_linear(x, w, norm_weight=g, out=out) is out
    assert_close(out, expected, torch.float32, scale=4.0)
    b = _randn((8,), torch.float32, device, 4)
    assert rms_linear(x, w, 1e-6, b, norm_weight=g, out=out) is out
    assert_close(out, expected + b.double(), torch.float32, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(1, 5), (130, 2048), (9, 4097)])
def test_linear_with_residual_adds_it_to_the_rounded_projection(device, dtype, n, k, monkeypatch):
    calls = _counting_gemv(monkeypatch)
    x, w = _randn((1, k), dtype, device, k), _randn((n, k), dtype, device, n, scale=k**-0.5)
    residual = _randn((1, n), dtype, device, 7, scale=4.0)
    got = linear(x, w, None, residual)
    # The add sees the projection in x's dtype, as the separate add it replaces does: compiled, the sums are
    # equal; Triton's interpreter rounds fp32 to half precision toward zero, so it may be an ulp off there.
    expected = (linear(x, w).double() + residual.double()).to(dtype)
    assert got.dtype == dtype
    if device.type == "cuda":
        assert torch.equal(got, expected)
    assert_close(got, expected, dtype)
    assert len(calls) == 2


def test_linear_with_residual_over_several_rows_is_the_projection_plus_the_residual(device, monkeypatch):
    monkeypatch.setattr(gemv, "gemv_launch", lambda *a, **kw: pytest.fail("the GEMV ran"))
    x, w, r = _randn((4, 30), torch.float32, device, 1), _randn((20, 30), torch.float32, device, 2), \
        _randn((4, 20), torch.float32, device, 3)
    assert_close(linear(x, w, None, r), F.linear(x.double(), w.double()) + r.double(), torch.float32, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, half, hidden", [(1, 300, 77), (1, 4100, 64), (3, 128, 5000), (2, 1, 1)])
def test_rms_silu_and_mul_matches_the_reference(device, dtype, rows, half, hidden):
    x = _randn((rows, 2 * half), dtype, device, half, scale=2.0)
    h = _randn((rows, hidden), dtype, device, hidden, scale=5.0)
    got = rms_silu_and_mul(x, h, 1e-5)
    assert got.shape == (rows, half) and got.dtype == dtype
    assert_close(got, reference.rms_silu_and_mul(x.double(), h.double(), 1e-5), dtype)


def test_rms_silu_and_mul_is_the_swiglu_of_the_normalized_projection(device):
    h, g = _randn((2, 48), torch.float32, device, 1, 3.0), _randn((48,), torch.float32, device, 2)
    w = _randn((64, 48), torch.float32, device, 3)  # [gate | up], 32 each
    unfolded = reference.gate_up_swiglu(reference.rms_norm(h.double(), g.double(), 1e-5), w.double())
    assert_close(rms_silu_and_mul(F.linear(h, w * g), h, 1e-5), unfolded, torch.float32, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pairs, k", [(1, 3), (37, 1000), (64, 2048), (5, 4096), (3, 4097)])
def test_rms_linear_swiglu_at_one_row_is_one_gemv_and_matches_the_reference(device, dtype, pairs, k, monkeypatch):
    calls = _counting_gemv(monkeypatch)
    x = _randn((1, k), dtype, device, k, scale=3.0)
    w = _randn((2 * pairs, k), dtype, device, pairs, scale=2 * k**-0.5)
    got = rms_linear_swiglu(x, w, 1e-5)
    assert got.shape == (1, pairs) and got.dtype == dtype
    assert_close(got, reference.rms_linear_swiglu(x.double(), w.double(), 1e-5), dtype, scale=4.0)
    assert [(c.get("rms_eps"), c.get("swiglu")) for c in calls] == [(1e-5, True)]


def test_rms_linear_swiglu_at_one_row_runs_the_gemv_even_where_cublas_would_fill_the_gpu(device, monkeypatch):
    # A gate/up projection has more rows than linear leaves to the GEMV (64 an SM): the fused SwiGLU keeps it.
    calls = _counting_gemv(monkeypatch)
    monkeypatch.setattr(gemv, "_few_rows_for_cublas", lambda n, device: False)
    x, w = _randn((1, 64), torch.float32, device, 1), _randn((32, 64), torch.float32, device, 2)
    assert_close(rms_linear_swiglu(x, w), reference.rms_linear_swiglu(x.double(), w.double()), torch.float32)
    assert len(calls) == 1
    linear(x, w)
    assert len(calls) == 1  # linear itself leaves such a matrix to cuBLAS


def test_rms_linear_swiglu_is_the_unfolded_mlp_input_over_paired_rows(device):
    # RMSNorm(h) with weight g, a [gate | up] projection and its SwiGLU, against g folded into W and W's rows
    # paired (gate row i, then up row i): what fold_norms makes of a model's post-attention norm and gate/up.
    h, g = _randn((1, 48), torch.float32, device, 1, 3.0), _randn((48,), torch.float32, device, 2)
    w = _randn((64, 48), torch.float32, device, 3)  # [gate | up], 32 each
    unfolded = reference.gate_up_swiglu(reference.rms_norm(h.double(), g.double(), 1e-5), w.double())
    gate, up = (w * g).chunk(2)
    paired = torch.stack((gate, up), 1).flatten(0, 1)
    assert_close(rms_linear_swiglu(h, paired, 1e-5), unfolded, torch.float32, scale=4.0)
    assert_close(rms_linear_swiglu(h.expand(3, 48), paired, 1e-5), unfolded.expand(3, 32), torch.float32, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 2 * 1500), (2, 5, 2 * 33)])
def test_silu_and_mul_over_pairs_matches_the_reference(device, dtype, shape):
    x = _randn(shape, dtype, device, shape[-1], scale=3.0)
    got = silu_and_mul(x, pairs=True)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    assert_close(got, reference.silu_and_mul(x.double(), pairs=True), dtype)
    gate, up = x[..., 0::2], x[..., 1::2]
    assert_close(got, reference.swiglu(gate.double(), up.double()), dtype)


def test_silu_and_mul_over_pairs_with_autograd_is_differentiable(device):
    x = _randn((2, 8), torch.float32, device, 1).requires_grad_(True)
    silu_and_mul(x, pairs=True).sum().backward()
    expected = torch.autograd.grad(reference.silu_and_mul(x, pairs=True).sum(), x)[0]
    assert_close(x.grad, expected.double(), torch.float32)


def test_bad_inputs_name_the_argument(device):
    x, w = torch.zeros(1, 8, device=device), torch.zeros(4, 8, device=device)
    with pytest.raises(ValueError, match="residual must have the output's shape \\(1, 4\\)"):
        linear(x, w, None, torch.zeros(1, 8, device=device))
    with pytest.raises(TypeError, match="residual must be torch.float32"):
        linear(x, w, None, torch.zeros(1, 4, device=device, dtype=torch.float16))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        linear(x, w, None, [0.0] * 4)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        rms_linear(x, w, -1.0)
    with pytest.raises(ValueError, match="x's last dim \\(8\\) must equal weight's in_features \\(5\\)"):
        rms_linear(x, torch.zeros(4, 5, device=device))
    with pytest.raises(ValueError, match="norm_weight must have shape \\(8,\\)"):
        rms_linear(x, w, norm_weight=torch.ones(4, device=device))
    with pytest.raises(TypeError, match="norm_weight must be torch.float32"):
        rms_linear(x, w, norm_weight=torch.ones(8, device=device, dtype=torch.float16))
    with pytest.raises(TypeError, match="norm_weight must be a torch.Tensor"):
        rms_linear(x, w, norm_weight=[1.0] * 8)
    with pytest.raises(ValueError, match="out must have the result's shape \\(1, 4\\)"):
        rms_linear(x, w, out=torch.zeros(1, 8, device=device))
    with pytest.raises(TypeError, match="out must be torch.float32"):
        rms_linear(x, w, out=torch.zeros(1, 4, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be contiguous"):
        rms_linear(x, w, out=torch.zeros(1, 8, device=device)[:, ::2])
    with pytest.raises(ValueError, match="must be even"):
        rms_silu_and_mul(torch.zeros(1, 7, device=device), x)
    with pytest.raises(ValueError, match="h must have x's rows \\(1,\\)"):
        rms_silu_and_mul(x, torch.zeros(2, 8, device=device))
    with pytest.raises(TypeError, match="h must be torch.float32"):
        rms_silu_and_mul(x, x.half())
    with pytest.raises(TypeError, match="h must be a torch.Tensor"):
        rms_silu_and_mul(x, None)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        rms_silu_and_mul(x, x, float("nan"))
    with pytest.raises(ValueError, match="for inference"):
        rms_silu_and_mul(x.clone().requires_grad_(True), x)
    with pytest.raises(ValueError, match="out_features must be even, got 3"):
        rms_linear_swiglu(x, torch.zeros(3, 8, device=device))
    with pytest.raises(ValueError, match="x's last dim \\(8\\) must equal weight's in_features \\(5\\)"):
        rms_linear_swiglu(x, torch.zeros(4, 5, device=device))
    with pytest.raises(TypeError, match="x has dtype torch.float32 but weight has dtype torch.float16"):
        rms_linear_swiglu(x, w.half())
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        rms_linear_swiglu(x, w, -1.0)
    with pytest.raises(TypeError, match="pairs must be a bool, got str"):
        silu_and_mul(x, pairs="yes")
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.zeros(1, 7, device=device), pairs=True)
