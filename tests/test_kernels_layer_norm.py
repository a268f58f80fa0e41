import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import DTYPES, assert_close, leaf, lower_block_cap

from fuselab.kernels import layer_norm, reference

WIDTHS = (1, 3, 1000, 5003)


def _inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(2))
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
    b = (0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
    return x, r, w, b


def _ref(x, w, b, **kw):
    return reference.layer_norm(x.double(), w.double(), None if b is None else b.double(), **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_forward_matches_reference(device, dtype, width):
    x, _, w, b = _inputs((3, width), dtype, device)
    assert_close(layer_norm(x, w, b), _ref(x, w, b), dtype)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu", "relu"])
def test_activation_after_the_norm(device, activation):
    x, _, w, b = _inputs((3, 200), torch.float32, device)
    assert_close(layer_norm(x, w, b, activation=activation), _ref(x, w, b, activation=activation), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_and_gelu_in_one_call(device, dtype):
    x, r, w, b = _inputs((2, 3, 1000), dtype, device)
    y, h = layer_norm(x, w, b, residual=r, activation="gelu")
    assert_close(h, x.double() + r.double(), dtype)
    assert_close(y, _ref(h, w, b, activation="gelu"), dtype)


def test_without_bias(device):
    x, _, w, _ = _inputs((3, 100), torch.float32, device)
    assert_close(layer_norm(x, w, None), _ref(x, w, None), torch.float32)


def test_variance_is_sound_for_a_large_mean(device, monkeypatch):
    # E[x²] − E[x]² loses every digit here in fp32 (errors of order 1); centred sums keep the
    # error at what rounding the fp32 mean of values near 1e4 costs, about 1e-3.
    x = (1e4 + torch.randn(2, 4096, generator=torch.Generator().manual_seed(0))).to(device)
    w, b = torch.ones(4096, device=device), torch.zeros(4096, device=device)
    expected = _ref(x, w, b)
    torch.testing.assert_close(layer_norm(x, w, b).double(), expected, rtol=0, atol=5e-3)
    lower_block_cap(monkeypatch, "layer_norm", 256)
    torch.testing.assert_close(layer_norm(x, w, b).double(), expected, rtol=0, atol=5e-3)


@pytest.mark.parametrize("residual", [False, True])
def test_looped_path_matches_fused_path(device, monkeypatch, residual):
    x, r, w, b = _inputs((3, 1000), torch.float32, device)
    r = r if residual else None
    fused = layer_norm(x, w, b, residual=r, activation="gelu")
    lower_block_cap(monkeypatch, "layer_norm", 128)
    looped = layer_norm(x, w, b, residual=r, activation="gelu")
    torch.testing.assert_close(looped, fused, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("looped", [False, True])
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_backward_matches_autograd_of_reference(device, monkeypatch, dtype, looped, activation):
    if looped:
        lower_block_cap(monkeypatch, "layer_norm", 128)
    x, _, w, b = _inputs((5, 300), dtype, device)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    ks = [t.clone().requires_grad_(True) for t in (x, w, b)]
    layer_norm(*ks, activation=activation).backward(dy)
    rs = [leaf(t) for t in (x, w, b)]
    reference.layer_norm(*rs, activation=activation).backward(dy.double())
    for k, ref in zip(ks, rs):
        assert_close(k.grad, ref.grad, dtype, scale=2)


@pytest.mark.parametrize("looped", [False, True])
def test_backward_through_residual_and_the_sum(device, monkeypatch, looped):
    if looped:
        lower_block_cap(monkeypatch, "layer_norm", 64)
    x, r, w, b = _inputs((4, 200), torch.float32, device)
    g = torch.Generator().manual_seed(2)
    dy, dh = torch.randn(x.shape, generator=g).to(device), torch.randn(x.shape, generator=g).to(device)
    ks = [t.clone().requires_grad_(True) for t in (x, r, w, b)]
    y, h = layer_norm(ks[0], ks[2], ks[3], residual=ks[1], activation="gelu_tanh")
    ((y * dy).sum() + (h * dh).sum()).backward()
    rs = [leaf(t) for t in (x, r, w, b)]
    y_ref, h_ref = reference.layer_norm(rs[0], rs[2], rs[3], residual=rs[1], activation="gelu_tanh")
    ((y_ref * dy.double()).sum() + (h_ref * dh.double()).sum()).backward()
    for k, ref in zip(ks, rs):
        assert_close(k.grad, ref.grad, torch.float32, scale=2)


def test_non_contiguous_input(device):
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(0)).to(device).t()
    w, b = torch.ones(64, device=device), torch.zeros(64, device=device)
    assert_close(layer_norm(x, w, b), _ref(x, w, b), torch.float32)


def test_empty_input_returns_empty(device):
    w, b = torch.ones(8, device=device), torch.zeros(8, device=device)
    x = torch.empty(0, 8, device=device, requires_grad=True)
    y = layer_norm(x, w, b)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 8)


def test_nan_propagates_to_its_row_only(device):
    x, _, w, b = _inputs((3, 16), torch.float32, device)
    x[1, 4] = float("nan")
    y = layer_norm(x, w, b)
    assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any()


def test_bad_inputs_raise_naming_the_argument(device):
    x = torch.randn(2, 8, device=device)
    w, b = torch.ones(8, device=device), torch.zeros(8, device=device)
    with pytest.raises(TypeError, match="x must be float32"):
        layer_norm(x.double(), w, b)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        layer_norm(x, w, torch.zeros(3, device=device))
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        layer_norm(x, torch.ones(2, 8, device=device), b)
    with pytest.raises(ValueError, match="activation must be"):
        layer_norm(x, w, b, activation="tanh")
    with pytest.raises(ValueError, match="residual has shape"):
        layer_norm(x, w, b, residual=torch.randn(8, device=device))


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 4), width=st.integers(1, 300), residual=st.booleans())
def test_any_shape_matches_reference(rows, width, residual):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, r, w, b = _inputs((rows, width), torch.float32, device, seed=width)
    r = r if residual else None
    out = layer_norm(x, w, b, residual=r)
    ref = _ref(x, w, b, residual=None if r is None else r.double())
    for o, e in zip(out, ref) if residual else [(out, ref)]:
        assert_close(o, e, torch.float32)
