import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPES, assert_close

from fuselab.kernels import fused_linear, reference
from fuselab.kernels.fused_linear import GEMV_CONFIG

# In-features around and above one GEMV block (GEMV_CONFIG.block_k): a tail, an exact multiple, several blocks.
IN_FEATURES = (1, 3, 1000, GEMV_CONFIG.block_k, 2 * GEMV_CONFIG.block_k + 6)
OUT_FEATURES = (1, 33)


def _randn(shape, dtype, device, seed, scale=1.0):
    return (scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype).to(device)


def _inputs(rows, n, k, dtype, device, gated=False):
    # Weights scaled by 1/sqrt(k): outputs of order one, so tolerances mean the same at every k.
    x = _randn((rows, 2 * k if gated else k), dtype, device, 0)
    w = _randn((n, k), dtype, device, 1, k**-0.5)
    r = _randn((rows, k), dtype, device, 2)
    nw = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(3))).to(dtype).to(device)
    return x, w, r, nw


def _double(*ts):
    return [t.double() for t in ts]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", IN_FEATURES)
@pytest.mark.parametrize("n", OUT_FEATURES)
def test_one_row_matches_reference(device, dtype, k, n):
    x, w, r, nw = _inputs(1, n, k, dtype, device)
    xd, wd, rd, nwd = _double(x, w, r, nw)
    assert_close(fused_linear(x, w), reference.fused_linear(xd, wd), dtype)
    assert_close(fused_linear(x, w, norm_weight=nw), reference.fused_linear(xd, wd, norm_weight=nwd), dtype)
    y, h = fused_linear(x, w, norm_weight=nw, residual=r)
    y_ref, h_ref = reference.fused_linear(xd, wd, norm_weight=nwd, residual=rd)
    assert_close(y, y_ref, dtype)
    assert_close(h, h_ref, dtype)
    assert y.dtype == h.dtype == dtype and y.shape == (1, n) and h.shape == (1, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", IN_FEATURES)
def test_one_row_gated_matches_reference(device, dtype, k):
    x, w, _, _ = _inputs(1, 33, k, dtype, device, gated=True)
    assert_close(fused_linear(x, w, gated=True), reference.fused_linear(*_double(x, w), gated=True), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", (2, 5))
def test_several_rows_match_reference(device, dtype, rows):
    x, w, r, nw = _inputs(rows, 33, 1000, dtype, device)
    xd, wd, rd, nwd = _double(x, w, r, nw)
    y, h = fused_linear(x, w, norm_weight=nw, residual=r)
    y_ref, h_ref = reference.fused_linear(xd, wd, norm_weight=nwd, residual=rd)
    assert_close(y, y_ref, dtype)
    assert_close(h, h_ref, dtype)
    g, _, _, _ = _inputs(rows, 33, 1000, dtype, device, gated=True)
    assert_close(fused_linear(g, w, gated=True), reference.fused_linear(*_double(g, w), gated=True), dtype)


def test_one_row_matches_the_unfused_kernels_that_it_replaces(device):
    """The fused prologue rounds where the unfused ops store: the same values up to summation order."""
    from fuselab.kernels import rms_norm, silu_and_mul

    x, w, r, nw = _inputs(1, 33, 1000, torch.bfloat16, device)
    y, h = fused_linear(x, w, norm_weight=nw, residual=r)
    normed, h_unfused = rms_norm(x, nw, 1e-6, r)
    assert torch.equal(h, h_unfused)
    # Only y's own rounding to bf16 is left between the two.
    assert_close(y, F.linear(normed.double(), w.double()), torch.bfloat16, scale=0.5)
    g, _, _, _ = _inputs(1, 33, 1000, torch.bfloat16, device, gated=True)
    assert_close(fused_linear(g, w, gated=True), F.linear(silu_and_mul(g).double(), w.double()), torch.bfloat16,
                 scale=0.5)


def test_leading_dims_out_and_strided_weight(device):
    x, w, r, nw = _inputs(1, 33, 100, torch.float32, device)
    y = fused_linear(x[0], w)  # 1-D x: 1-D y
    assert y.shape == (33,)
    assert_close(y, reference.fused_linear(*_double(x[0], w)), torch.float32)
    for rows in (1, 3):
        xs = _randn((rows, 100), torch.float32, device, 4)
        out = torch.full((rows, 33), float("nan"), device=device)
        assert fused_linear(xs, w, norm_weight=nw, out=out) is out
        assert_close(out, reference.fused_linear(*_double(xs, w), norm_weight=nw.double()), torch.float32)
    wt = w.t().contiguous().t()  # a column-major view: read after one explicit copy
    assert_close(fused_linear(x, wt), reference.fused_linear(*_double(x, w)), torch.float32)


def test_empty_inputs(device):
    w = _randn((5, 0), torch.float32, device, 0)
    assert torch.equal(fused_linear(torch.zeros(1, 0, device=device), w), torch.zeros(1, 5, device=device))
    assert fused_linear(torch.zeros(0, 4, device=device), _randn((5, 4), torch.float32, device, 0)).shape == (0, 5)


def test_nan_propagates(device):
    x, w, _, _ = _inputs(1, 8, 100, torch.float32, device)
    x[0, 7] = float("nan")
    assert fused_linear(x, w).isnan().all()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(x="x"), TypeError, "x must be a torch.Tensor"),
        (dict(weight=torch.zeros(8)), ValueError, "weight must be 2-D"),
        (dict(x=torch.zeros(1, 7)), ValueError, "x's last dim"),
        (dict(x=torch.zeros(1, 8, dtype=torch.float16)), TypeError, "dtype"),
        (dict(x=torch.zeros(1, 8, dtype=torch.int32)), TypeError, "x must be float32"),
        (dict(gated=True), ValueError, r"twice weight's in_features"),
        (dict(gated=True, x=torch.zeros(1, 16), norm_weight=torch.ones(8)), ValueError, "gated=True takes no"),
        (dict(residual=torch.zeros(1, 8)), ValueError, "residual is added before the norm"),
        (dict(norm_weight=torch.ones(7)), ValueError, "norm_weight must have shape"),
        (dict(norm_weight=torch.ones(8), residual=torch.zeros(2, 8)), ValueError, "residual has shape"),
        (dict(norm_weight=torch.ones(8), eps=-1.0), ValueError, "eps"),
        (dict(gated=1), TypeError, "gated must be a bool"),
        (dict(out=torch.zeros(1, 5)), ValueError, "out must be a contiguous"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(device, kwargs, error, match):
    args = dict(x=torch.zeros(1, 8), weight=torch.zeros(4, 8))
    args.update(kwargs)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    x, w = args.pop("x"), args.pop("weight")
    with pytest.raises(error, match=match):
        fused_linear(x, w, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 8192), (6144, 4096), (4096, 14336), (128256, 2048)])
def test_llama_projections_on_gpu(n, k):
    x, w, r, nw = _inputs(1, n, k, torch.bfloat16, "cuda")
    y, h = fused_linear(x, w, norm_weight=nw, residual=r)
    y_ref, h_ref = reference.fused_linear(x.double(), w.double(), norm_weight=nw.double(), residual=r.double())
    assert_close(y, y_ref, torch.bfloat16)
    assert_close(h, h_ref, torch.bfloat16)
    g = _randn((1, 2 * k), torch.bfloat16, "cuda", 5)
    assert_close(fused_linear(g, w, gated=True), reference.fused_linear(g.double(), w.double(), gated=True),
                 torch.bfloat16)
