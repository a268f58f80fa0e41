"""x rounded by the kernel that makes it (rounded_rows): RMSNorm and SwiGLU writing the codes quantized_linear
would round x to, against float64 norms and gates and against the unfused kernels, and quantized_linear taking
them in place of x."""

import pytest
import torch
from kernel_checks import DTYPES, kernel_module

from fuselab.kernels import (
    RoundedRows, quantize_weight, quantized_linear, rms_norm, rms_norm_rounded, silu_and_mul, silu_and_mul_rounded)
from fuselab.kernels.quant_pack import packed_words, values_per_word
from fuselab.kernels.reference_quant import quantize_activations

qw = kernel_module("quantized_gemm_w8a8")
ql = kernel_module("quantized_linear")
rr = kernel_module("rounded_rows")
FORMATS = ("int4", "int8", "fp8")
WIDTHS = (37, 200, 1000)


def _randn(shape, dtype, device, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _kp(k, fmt):
    return values_per_word(fmt) * packed_words(k, fmt)


def _in_x_order(rows: RoundedRows) -> torch.Tensor:
    """The codes as float64 values (codes · scale), back in x's element order, the padding dropped."""
    kp, k = rows.codes.shape[1], rows.in_features
    b = torch.arange(kp)
    if rows.fmt == "int4":
        src = (b // 128) * 128 + (b % 4) * 32 + ((b % 128) // 64) * 16 + (b % 64) // 4
    else:
        src = (b // 64) * 64 + (b % 4) * 16 + (b % 64) // 4
    values = rows.codes.cpu().double() * rows.scales.cpu().double()[:, None]
    out = torch.zeros(rows.rows, kp, dtype=torch.float64)
    out[:, src] = values
    return out[:, :k]


def _assert_rounds(rows: RoundedRows, expected: torch.Tensor, fmt: str):
    """Each value within half a code step (int8), or e4m3's relative half step (fp8), of the float64 result
    (which the kernel first rounds to x's dtype: one more rounding of that dtype)."""
    got = _in_x_order(rows)
    amax = expected.abs().amax(dim=-1, keepdim=True)
    if fmt == "fp8":
        bound = expected.abs() * 2**-4 + amax / 448 * 2**-9
    else:
        bound = amax / 127 / 2
    slack = expected.abs() * (2**-7 if rows.dtype == torch.bfloat16 else 2**-10)
    assert ((got - expected).abs() <= 1.01 * bound + 2 * slack + 1e-12).all()


def _norm64(x, w, eps, residual):
    h = x.double() if residual is None else (x + residual).double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", WIDTHS)
@pytest.mark.parametrize("with_residual", [False, True], ids=["no-residual", "residual"])
def test_rms_norm_rounded_rounds_the_norm(device, dtype, fmt, k, with_residual):
    x, w = _randn((3, k), dtype, device, k), _randn((k,), dtype, device, 1)
    residual = _randn((3, k), dtype, device, 2) if with_residual else None
    rows, h = rms_norm_rounded(x, w, 1e-6, residual, fmt)
    assert rows.fmt == fmt and rows.dtype == dtype and rows.in_features == k
    assert tuple(rows.codes.shape) == (3, _kp(k, fmt)) and rows.scales.dtype == torch.float32
    _assert_rounds(rows, _norm64(x.cpu(), w.cpu(), 1e-6, None if residual is None else residual.cpu()), fmt)
    if residual is None:
        assert h is x
    else:
        assert torch.equal(h, rms_norm(x, w, 1e-6, residual)[1])
    # The unfused pair's codes: the same, but for a rare one the norm's summation order tips over (at most 1).
    y = rms_norm(x, w, 1e-6, residual) if residual is None else rms_norm(x, w, 1e-6, residual)[0]
    codes, scales = qw.quantize_rows(y, _kp(k, fmt), fmt)
    torch.testing.assert_close(rows.scales, scales, rtol=1e-6, atol=0)
    differ = rows.codes.view(torch.int8).int() != codes.view(torch.int8).int()
    assert differ.float().mean() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", WIDTHS)
def test_silu_and_mul_rounded_is_the_unfused_pair(device, dtype, fmt, k):
    x = _randn((2, 2 * k), dtype, device, k)
    rows = silu_and_mul_rounded(x, fmt)
    g, u = x.cpu().double().chunk(2, dim=-1)
    _assert_rounds(rows, g * torch.sigmoid(g) * u, fmt)
    codes, scales = qw.quantize_rows(silu_and_mul(x), _kp(k, fmt), fmt)
    assert torch.equal(rows.codes.view(torch.int8), codes.view(torch.int8)) and torch.equal(rows.scales, scales)


def test_a_strided_gate_up_reads_its_rows(device):
    x = _randn((2, 3, 100), torch.float32, device, 4)[:, 1]  # rows 300 apart
    rows = silu_and_mul_rounded(x, "int8")
    expected = silu_and_mul_rounded(x.contiguous(), "int8")
    assert torch.equal(rows.codes, expected.codes) and torch.equal(rows.scales, expected.scales)


def test_rows_wider_than_a_program_holds_take_the_unfused_pair(device, monkeypatch):
    k = 300
    x, w, r = _randn((2, k), torch.float32, device, 5), _randn((k,), torch.float32, device, 6), _randn(
        (2, k), torch.float32, device, 7)
    fused_norm, fused_gate = rms_norm_rounded(x, w, 1e-5, r, "int4"), silu_and_mul_rounded(torch.cat([x, r], -1), "int4")
    monkeypatch.setattr(rr, "MAX_QUANT_BLOCK", 128)
    wide_norm, wide_gate = rms_norm_rounded(x, w, 1e-5, r, "int4"), silu_and_mul_rounded(torch.cat([x, r], -1), "int4")
    assert torch.equal(wide_norm[1], fused_norm[1])
    for wide, fused in ((wide_norm[0], fused_norm[0]), (wide_gate, fused_gate)):
        assert (wide.codes.int() - fused.codes.int()).abs().max() <= 1
        torch.testing.assert_close(wide.scales, fused.scales, rtol=1e-6, atol=0)


def test_an_all_zero_row_gives_zero_codes(device):
    rows, _ = rms_norm_rounded(torch.zeros(1, 64, device=device), torch.ones(64, device=device), 1e-6, None, "int8")
    assert not rows.codes.any() and (rows.scales > 0).all()


def test_no_rows(device):
    rows, h = rms_norm_rounded(torch.zeros(0, 64, device=device), torch.ones(64, device=device), 1e-6, None, "int4")
    assert tuple(rows.codes.shape) == (0, 128) and h.shape == (0, 64)
    assert tuple(silu_and_mul_rounded(torch.zeros(0, 64, device=device), "fp8").codes.shape) == (0, 64)


# --------------------------------------------------------------------------------------------
# quantized_linear takes them
# --------------------------------------------------------------------------------------------

# (format, group, the dispatch threshold that puts a small weight's rows on the path that rounds x, launcher)
PATHS = [("int4", 128, "A8_MIN_WEIGHTS", 1), ("int8", 0, "A8_MIN_WEIGHTS", 1),
         ("fp8", 0, "W8A8_ONE_ROW_MIN_WEIGHTS", 1), ("int8", 0, "A8_MIN_WEIGHTS", 16), ("fp8", 0, "A8_MIN_WEIGHTS", 17)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt, group, threshold, m", PATHS)
def test_quantized_linear_of_rounded_rows_is_that_of_x(device, monkeypatch, dtype, fmt, group, threshold, m):
    monkeypatch.setattr(ql, threshold, 1)
    n, k = 45, 256
    weight = quantize_weight(_randn((n, k), torch.float32, device, 8) * k**-0.5, fmt, group or 128)
    x, w = _randn((m, k), dtype, device, 9), _randn((k,), dtype, device, 10)
    bias = _randn((n,), dtype, device, 11)
    rows, _ = rms_norm_rounded(x, w, 1e-6, None, fmt)
    y = quantized_linear(rows, weight, bias)
    assert y.shape == (m, n) and y.dtype == dtype
    codes, scales = qw.quantize_rows(rms_norm(x, w, 1e-6), rows.codes.shape[1], fmt)
    same = RoundedRows(codes, scales, fmt, dtype, k)  # the unfused pair's codes, through the same product
    assert torch.equal(quantized_linear(same, weight, bias), quantized_linear(rms_norm(x, w, 1e-6), weight, bias))
    out = torch.empty(m, n, device=device, dtype=dtype)
    assert quantized_linear(rows, weight, bias, out=out) is out and torch.equal(out, y)


def test_bad_rounded_rows_are_refused(device, monkeypatch):
    monkeypatch.setattr(ql, "A8_MIN_WEIGHTS", 1)
    k = 256
    int8 = quantize_weight(_randn((8, k), torch.float32, device, 1), "int8")
    int4 = quantize_weight(_randn((8, k), torch.float32, device, 2), "int4", 128)
    x, w = _randn((1, k), torch.float32, device, 3), torch.ones(k, device=device)
    rows = rms_norm_rounded(x, w, 1e-6, None, "int8")[0]
    with pytest.raises(ValueError, match="rounded for a int8 weight of 256 inputs, but weight is int4"):
        quantized_linear(rows, int4)
    with pytest.raises(ValueError, match="in_features=128"):
        quantized_linear(rows, quantize_weight(_randn((8, 128), torch.float32, device), "int8"))
    two = rms_norm_rounded(_randn((2, k), torch.float32, device, 4), w, 1e-6, None, "int8")[0]
    with pytest.raises(ValueError, match="2 rows of this int8 weight multiply x as it is"):
        quantized_linear(two, int8)
    with pytest.raises(ValueError, match=r"x.codes must be a contiguous \[rows, 256\] 8-bit tensor"):
        quantized_linear(rows._replace(codes=rows.codes[:, :128]), int8)
    with pytest.raises(ValueError, match=r"x.scales must be a \(1,\) float32 tensor"):
        quantized_linear(rows._replace(scales=rows.scales.double()), int8)
    with pytest.raises(ValueError, match=r"out must be a contiguous \(1, 8\) torch.float32"):
        quantized_linear(rows, int8, out=torch.empty(1, 9, device=device))
    with pytest.raises(ValueError, match="bias must be a"):
        quantized_linear(rows, int8, bias=torch.zeros(8, device=device, dtype=torch.float16))


def test_bad_inputs_name_the_argument(device):
    x, w = torch.ones(2, 64, device=device), torch.ones(64, device=device)
    with pytest.raises(ValueError, match="fmt must be one of"):
        rms_norm_rounded(x, w, 1e-6, None, "int3")
    with pytest.raises(ValueError, match="fmt must be one of"):
        silu_and_mul_rounded(x, "int16")
    with pytest.raises(ValueError, match=r"weight must be a \(64,\) tensor"):
        rms_norm_rounded(x, torch.ones(63, device=device), 1e-6, None, "int8")
    with pytest.raises(ValueError, match="residual must match x"):
        rms_norm_rounded(x, w, 1e-6, torch.ones(2, 63, device=device), "int8")
    with pytest.raises(ValueError, match="eps must be"):
        rms_norm_rounded(x, w, -1.0, None, "int8")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rms_norm_rounded([1.0], w, 1e-6, None, "int8")
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        silu_and_mul_rounded(torch.ones(2, 64, dtype=torch.int32, device=device), "int8")
    with pytest.raises(ValueError, match=r"last dim must be even \(\[gate \| up\]\)"):
        silu_and_mul_rounded(torch.ones(2, 63, device=device), "int8")
