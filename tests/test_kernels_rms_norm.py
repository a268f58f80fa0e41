import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import DTYPES, assert_close, leaf, lower_block_cap

from fuselab.kernels import reference, rms_norm

WIDTHS = (1, 3, 1000, 5003)


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype).to(device)
    r = torch.randn(shape, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
    return x, r, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_forward_matches_reference(device, dtype, width):
    x, _, w = _inputs((3, width), dtype, device)
    assert_close(rms_norm(x, w), reference.rms_norm(x.double(), w.double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_returns_norm_of_sum_and_the_sum(device, dtype):
    x, r, w = _inputs((2, 3, 1000), dtype, device)
    y, h = rms_norm(x, w, residual=r)
    assert y.dtype == h.dtype == dtype and y.shape == h.shape == x.shape
    assert_close(h, x.double() + r.double(), dtype)
    assert_close(y, reference.rms_norm(h.double(), w.double()), dtype)


@pytest.mark.parametrize("residual", [False, True])
def test_looped_path_matches_fused_path(device, monkeypatch, residual):
    x, r, w = _inputs((3, 1000), torch.float32, device)
    r = r if residual else None
    fused = rms_norm(x, w, residual=r)
    lower_block_cap(monkeypatch, "rms_norm", 128)
    looped = rms_norm(x, w, residual=r)
    torch.testing.assert_close(looped, fused, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("looped", [False, True])
def test_backward_matches_autograd_of_reference(device, monkeypatch, dtype, looped):
    if looped:
        lower_block_cap(monkeypatch, "rms_norm", 128)
    x, r, w = _inputs((5, 300), dtype, device)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    xk, wk = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    rms_norm(xk, wk).backward(dy)
    xr, wr = leaf(x), leaf(w)
    reference.rms_norm(xr, wr).backward(dy.double())
    assert_close(xk.grad, xr.grad, dtype, scale=2)
    assert_close(wk.grad, wr.grad, dtype, scale=2)


@pytest.mark.parametrize("looped", [False, True])
def test_backward_through_residual_and_the_sum(device, monkeypatch, looped):
    if looped:
        lower_block_cap(monkeypatch, "rms_norm", 64)
    x, r, w = _inputs((4, 200), torch.float32, device)
    g = torch.Generator().manual_seed(2)
    dy, dh = torch.randn(x.shape, generator=g).to(device), torch.randn(x.shape, generator=g).to(device)
    ks = [t.clone().requires_grad_(True) for t in (x, r, w)]
    y, h = rms_norm(ks[0], ks[2], residual=ks[1])
    ((y * dy).sum() + (h * dh).sum()).backward()
    rs = [leaf(t) for t in (x, r, w)]
    y_ref, h_ref = reference.rms_norm(rs[0], rs[2], residual=rs[1])
    ((y_ref * dy.double()).sum() + (h_ref * dh.double()).sum()).backward()
    for k, ref in zip(ks, rs):
        assert_close(k.grad, ref.grad, torch.float32, scale=2)


def test_unused_sum_gets_no_gradient_contribution(device):
    x, r, w = _inputs((2, 64), torch.float32, device)
    xk = x.clone().requires_grad_(True)
    y, _ = rms_norm(xk, w, residual=r)
    y.sum().backward()
    xr = leaf(x)
    reference.rms_norm(xr, w.double(), residual=r.double())[0].sum().backward()
    assert_close(xk.grad, xr.grad, torch.float32)


def test_non_contiguous_input(device):
    x, _, w = _inputs((64, 6), torch.float32, device)
    xt = x.t()  # (6, 64), strided
    assert not xt.is_contiguous()
    assert_close(rms_norm(xt, w.new_ones(64)), reference.rms_norm(xt.double(), w.new_ones(64).double()), torch.float32)


def test_empty_input_returns_empty(device):
    w = torch.ones(8, device=device)
    assert rms_norm(torch.empty(0, 8, device=device), w).shape == (0, 8)
    y, h = rms_norm(torch.empty(0, 8, device=device), w, residual=torch.empty(0, 8, device=device))
    assert y.shape == h.shape == (0, 8)
    x = torch.empty(0, 8, device=device, requires_grad=True)
    rms_norm(x, w).sum().backward()
    assert x.grad.shape == (0, 8)


def test_nan_propagates_to_its_row_only(device):
    x, _, w = _inputs((3, 16), torch.float32, device)
    x[1, 4] = float("nan")
    y = rms_norm(x, w)
    assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any()


def test_bad_inputs_raise_naming_the_argument(device):
    x = torch.randn(2, 8, device=device)
    w = torch.ones(8, device=device)
    with pytest.raises(TypeError, match="x must be float32"):
        rms_norm(x.to(torch.int32), w)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rms_norm([1.0], w)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match="residual has shape"):
        rms_norm(x, w, residual=torch.randn(2, 4, device=device))
    with pytest.raises(TypeError, match="residual has dtype"):
        rms_norm(x, w, residual=x.half())
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, eps=-1.0)
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        rms_norm(torch.tensor(1.0, device=device), torch.ones(1, device=device))
    if device.type == "cuda":
        with pytest.raises(ValueError, match="weight must be a cuda tensor"):
            rms_norm(x, w.cpu())


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 4), width=st.integers(1, 300), residual=st.booleans())
def test_any_shape_matches_reference(rows, width, residual):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, r, w = _inputs((rows, width), torch.float32, device, seed=width)
    r = r if residual else None
    out = rms_norm(x, w, residual=r)
    ref = reference.rms_norm(x.double(), w.double(), residual=None if r is None else r.double())
    if residual:
        assert_close(out[0], ref[0], torch.float32)
        assert_close(out[1], ref[1], torch.float32)
    else:
        assert_close(out, ref, torch.float32)
