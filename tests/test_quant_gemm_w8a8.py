"""quantized_gemm_w8a8 (int8 and fp8 as W8A8): the row quantizer's codes and scales against torch's
rounding (int8: to nearest even within ±127; fp8: torch's e4m3 conversion), int8's decode of the
stored q + 128, the GEMM at explicit configs against float64 products of the same codes and against
the unquantized activations within the bound of their rounding, split-K, w8a8_config's rule, and
quantized_linear's dispatch to it."""

import pytest
import torch
from kernel_checks import DTYPES, assert_close, kernel_module

from fuselab.graphs import bucket_for, default_buckets
from fuselab.kernels import QuantizedWeight, quantize_weight, quantized_linear, reference_quant
from fuselab.kernels._common.launch import cdiv
from fuselab.kernels.quant_pack import pack_codes, packed_words
from fuselab.kernels.reference_quant import dequantize

qw = kernel_module("quantized_gemm_w8a8")
ql = kernel_module("quantized_linear")
FORMATS = ("int8", "fp8")
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
FP8_VALUES = FP8_VALUES[FP8_VALUES.isfinite()].unique()  # sorted, -0.0 and 0.0 as one
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _randn(shape, dtype, device, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _weight(n, k, device, seed=0, fmt="fp8"):
    return quantize_weight(_randn((n, k), torch.float32, device, seed) * k**-0.5, fmt)


def _byte_order(kp):
    """The element of x each byte of a packed 8-bit row multiplies (quant_pack: byte 4·i + j of a
    64-byte block holds element 16·j + i)."""
    b = torch.arange(kp)
    return (b // 64) * 64 + (b % 4) * 16 + (b % 64) // 4


def _reference_quantize(x, kp, fmt):
    """(codes [M, kp] in the weight's byte order, scales [M]): torch's fp32 division and rounding."""
    codes, scales = reference_quant.quantize_activations(x.cpu(), fmt)
    src = _byte_order(kp)
    out = torch.zeros(x.shape[0], kp, dtype=CODE_DTYPES[fmt])
    out[:, src < x.shape[1]] = codes[:, src[src < x.shape[1]]]
    return out, scales


def _strided(x, pad):
    """x with rows `pad` elements longer than its columns (unit column stride)."""
    wide = torch.zeros(x.shape[0], x.shape[1] + pad, dtype=x.dtype, device=x.device)
    wide[:, 3:3 + x.shape[1]] = x
    return wide[:, 3:3 + x.shape[1]]


def _bits(codes):
    return codes.cpu().view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes.cpu()


def _assert_quantized_as_torch(x, kp, fmt="fp8"):
    codes, scales = qw.quantize_rows(x, kp, fmt)
    expected_codes, expected_scales = _reference_quantize(x, kp, fmt)
    assert codes.shape == (x.shape[0], kp) and codes.dtype == CODE_DTYPES[fmt]
    assert torch.equal(scales.cpu(), expected_scales)
    assert torch.equal(_bits(codes), _bits(expected_codes))
    return codes, scales


# --------------------------------------------------------------------------------------------
# The row quantizer
# --------------------------------------------------------------------------------------------

ROW_SCALES = [1.0, 1e-3, 300.0, 0.0, 1e-30]  # row 3 all zeros


def _rows(k, pad, dtype, device):
    x = _randn((5, k), torch.float32, device, k) * torch.tensor(ROW_SCALES, device=device)[:, None]
    return _strided(x.to(dtype), pad) if pad else x.to(dtype)


def _in_byte_order(x, kp):
    """x [M, K] as float64 on the host, gathered in the weight's byte order (zeros past K)."""
    k = x.shape[1]
    xs = x.double().cpu()[:, _byte_order(kp).clamp(max=k - 1)]
    xs[:, _byte_order(kp) >= k] = 0
    return xs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, pad", [(200, 0), (64, 0), (300, 40), (7, 5)])
def test_rows_quantize_to_torchs_e4m3_codes_in_the_weights_byte_order(device, dtype, k, pad):
    x = _rows(k, pad, dtype, device)
    codes, scales = _assert_quantized_as_torch(x, 4 * packed_words(k, "fp8"))
    assert scales[3].item() == torch.finfo(torch.float32).tiny and not codes[3].float().any()  # the zero row
    # Each element within half a step of e4m3 (2^-4 relative, 2^-10 · scale below its normal range).
    back = codes.float()[:, :].cpu().double() * scales.cpu().double()[:, None]
    xs = _in_byte_order(x, codes.shape[1])
    bound = 2.0**-4 * xs.abs() + 2.0**-10 * scales.cpu().double()[:, None]
    assert ((back - xs).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, pad", [(200, 0), (64, 0), (300, 40), (7, 5)])
def test_rows_quantize_to_torchs_int8_codes_in_the_weights_byte_order(device, dtype, k, pad):
    x = _rows(k, pad, dtype, device)
    codes, scales = _assert_quantized_as_torch(x, 4 * packed_words(k, "int8"), "int8")
    assert scales[3].item() == torch.finfo(torch.float32).tiny and not codes[3].any()  # the zero row
    assert codes.abs().max().item() == 127  # each nonzero row's amax is a code of ±127, none is -128
    # Each element within half a step (s / 2, plus the division's rounding).
    s = scales.cpu().double()[:, None]
    xs = _in_byte_order(x, codes.shape[1])
    assert ((codes.cpu().double() * s - xs).abs() <= 0.5 * s * (1 + 2.0**-20) + 2.0**-22 * xs.abs()).all()


def test_every_e4m3_value_and_midpoint_rounds_as_torch_rounds_it(device):
    # amax 448: the scale is 1, so x / s is x; the midpoints between neighbours are ties (to even),
    # including those where rounding up carries into the exponent and those below the normal range.
    mids = (FP8_VALUES[1:] + FP8_VALUES[:-1]) / 2
    nudged = torch.cat([mids.nextafter(mids + 1), mids.nextafter(mids - 1)])
    row = torch.cat([FP8_VALUES, mids, nudged, torch.tensor([-0.0, 2.0**-12, -(2.0**-11)])])
    x = row[None, :].to(device)
    _assert_quantized_as_torch(x, 4 * packed_words(x.shape[1], "fp8"))


def _int8_ties_row():
    """Every integer of ±127 with the midpoints between them (ties) and their neighbours: at amax 127
    the scale is 1, so x / s is x."""
    ints = torch.arange(-127, 128, dtype=torch.float32)
    mids = ints[:-1] + 0.5
    return torch.cat([ints, mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1), torch.tensor([-0.0, 0.25])])


def test_every_int8_code_and_tie_rounds_to_nearest_even(device):
    x = _int8_ties_row()[None, :].to(device)
    codes, scales = _assert_quantized_as_torch(x, 4 * packed_words(x.shape[1], "int8"), "int8")
    assert scales.item() == 1.0
    ints = torch.arange(-127, 128)
    got = codes.cpu()[0, torch.argsort(_byte_order(codes.shape[1]))][:x.shape[1]]  # back to x's order
    assert torch.equal(got[:255], ints.to(torch.int8))
    mids = ints[:-1].double() + 0.5
    assert torch.equal(got[255:509], (mids - 0.5 + (ints[:-1] % 2 != 0)).to(torch.int8))  # ties to the even one


def test_int8_amax_lands_on_127_where_x_over_s_exceeds_it(device):
    # amax / fl(amax / 127) computes a little above 127 for some amax: the code is still ±127.
    candidates = torch.linspace(1.0, 2.0, 20001)
    over = candidates[candidates / (candidates / 127.0) > 127.0][:6]
    assert over.numel() == 6
    x = _randn((6, 130), torch.float32, device, 3).clamp(-1, 1) * 0.5
    x[:, 7], x[:, 100] = over.to(device), -over.to(device)
    codes, _ = _assert_quantized_as_torch(x, 4 * packed_words(130, "int8"), "int8")
    assert codes.max().item() == 127 and codes.min().item() == -127


def test_int8_rows_below_the_scale_floor_keep_their_small_codes(device):
    # amax / 127 under fp32's smallest normal: s is that floor, the codes x / floor (a few units).
    x = torch.tensor([[1e-37, -5e-38, 3e-39, 0.0]], device=device)
    codes, scales = _assert_quantized_as_torch(x, 64, "int8")
    assert scales.item() == torch.finfo(torch.float32).tiny and 0 < codes.abs().max().item() < 127


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_longer_than_a_block_take_two_passes(device, monkeypatch, fmt):
    monkeypatch.setattr(qw, "MAX_QUANT_BLOCK", 64)
    x = _randn((3, 300), torch.bfloat16, device, 1)
    x[1, 250] = 40.0  # the row's amax in its last block
    _assert_quantized_as_torch(x, 4 * packed_words(300, fmt), fmt)


# --------------------------------------------------------------------------------------------
# The GEMM
# --------------------------------------------------------------------------------------------


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0,
           fmt: str = "fp8") -> None:
    """assert_close on the host (the references are CPU float64). On a GPU the fp8 MMA sums a step's
    products in an accumulator narrower than fp32 (Hopper), so fp32 results get bf16's tolerance there;
    int8's int32 sums are exact on both."""
    if fmt == "fp8" and dtype == torch.float32 and torch.cuda.is_available():  # compiled, on the GPU
        dtype = torch.bfloat16
    assert_close(actual.cpu(), expected.cpu(), dtype, scale)


# (m, n, k, (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) or None for the rule, x dtype, bias,
# row padding of x). Every K but 256 ends in a padded block; n past the tile on most.
CASES = [
    (1, 37, 200, (16, 64, 64, 1, 4, 3), torch.bfloat16, True, 0),  # one row of x in a 16-row tile
    (2, 37, 200, (16, 64, 64, 1, 4, 3), torch.float32, True, 0),  # one split: y stored directly
    (16, 70, 300, (16, 64, 64, 2, 4, 3), torch.bfloat16, False, 8),  # 5 steps in 2 splits; 2 tiles of W
    (17, 37, 130, (32, 64, 64, 3, 4, 2), torch.float16, True, 0),  # 3 splits of one step each
    (33, 100, 500, (16, 128, 128, 4, 8, 3), torch.bfloat16, True, 0),  # 3 tiles of x, 4 splits
    (64, 37, 256, (64, 64, 64, 8, 4, 3), torch.float32, False, 3),  # 4 steps, 8 splits: 4 with none
    (64, 300, 256, None, torch.bfloat16, True, 0),  # the rule's pick
    (70, 45, 330, (64, 64, 64, 2, 4, 3), torch.float16, False, 0),  # 2 tiles of x, the second 6 rows
]


def _run(x, weight, bias, config, counters=None):
    y = torch.full((x.shape[0], weight.out_features), float("nan"), dtype=x.dtype, device=x.device)
    qw.launch_w8a8(x, weight, bias, y, config=config, counters=counters)
    return y


def _expected(x, weight, bias):
    """float64 products of the codes the kernel multiplies: x rounded as torch rounds it, and W."""
    codes, scales = _reference_quantize(x, 4 * weight.data.shape[1], weight.fmt)
    xq = torch.zeros(x.shape, dtype=torch.float64)
    src = _byte_order(codes.shape[1])
    xq[:, src[src < x.shape[1]]] = codes[:, src < x.shape[1]].double()
    y = (xq * scales.double()[:, None]) @ dequantize(weight).cpu().t()
    return y if bias is None else y + bias.double().cpu()


def _rounding_bound(xd, w, fmt):
    """|y - x · Wᵀ| that x's rounding allows: fp8 moves each product by 2^-4 of its x element
    (2^-10 · s_m absolute below e4m3's normal range), int8 by s_m / 2 = amax / 254 of it."""
    amax = xd.abs().amax(dim=1)[:, None]
    if fmt == "int8":
        return (amax / 254.0) * w.abs().sum(dim=1)[None, :]
    return 2.0**-4 * (xd.abs() @ w.abs().t()) + 2.0**-10 * (amax / 448.0) * w.abs().sum(dim=1)[None, :]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m, n, k, config, dtype, with_bias, pad", CASES)
def test_every_config_matches_float64_products_of_the_codes(device, fmt, m, n, k, config, dtype, with_bias, pad):
    weight = _weight(n, k, device, m, fmt)
    bias = _randn((n,), dtype, device, 2) if with_bias else None
    x = _randn((m, k), dtype, device, k)
    x = _strided(x, pad) if pad else x
    y = _run(x, weight, bias, config)
    # Exact products summed in fp32 (int8: in int32) and scaled twice: the float64 sum differs in the last bits.
    _close(y.cpu(), _expected(x, weight, bias), dtype, scale=4.0, fmt=fmt)
    # Against the unquantized x: within the bound of x's rounding, plus the output's (half a bf16 step
    # is 2^-8 of |y|).
    w = dequantize(weight).cpu()
    xd = x.double().cpu()
    exact = xd @ w.t() + (0 if bias is None else bias.double().cpu())
    bound = _rounding_bound(xd, w, fmt)
    assert ((y.cpu().double() - exact).abs() <= bound + 2.0**-7 * (exact.abs() + bound) + 1e-5).all()


def test_int8_codes_decode_to_q_with_one_xor(device):
    # Stored bytes q + 128 for q in -127, -1, 0, 1, 127 at every byte of a 64-column block (5 rows, each
    # value at each position once per 5 rows); x = 127 · I makes s_m = 1 and each row of x a code of 127
    # at one column, so y = 127 · q exactly: a wrong decode (q + 128, or -128 for 0) shows at once.
    q = torch.tensor([-127, -1, 0, 1, 127])
    stored = torch.stack([q.roll(-r)[torch.arange(64) % 5] for r in range(5)])  # [5, 64]
    assert torch.equal(((stored + 128) ^ 0x80).to(torch.uint8).view(torch.int8).long(), stored)
    weight = QuantizedWeight(pack_codes((stored + 128).to(device), "int8"), torch.ones(5, device=device),
                             "int8", 0, 64)
    x = 127.0 * torch.eye(64, device=device)
    for config in ((64, 64, 64, 1, 4, 3), (16, 64, 32, 2, 4, 3)):
        y = _run(x, weight, None, config)
        assert torch.equal(y.cpu(), 127.0 * stored.t().float()), config


@pytest.mark.parametrize("fmt", FORMATS)
def test_split_k_repeats_itself_and_the_one_split_sum(device, fmt):
    m, n, k = 40, 70, 600  # 3 tiles of x, 2 of W; 5 steps of 128 bytes
    weight = _weight(n, k, device, 1, fmt)
    x = _randn((m, k), torch.bfloat16, device, 2)
    one = _run(x, weight, None, (16, 64, 128, 1, 4, 3))
    counters = torch.zeros(cdiv(m, 16) * cdiv(n, 64), dtype=torch.int32, device=device)
    for split in (2, 4):
        first = _run(x, weight, None, (16, 64, 128, split, 4, 3), counters)
        assert counters.tolist() == [0] * counters.numel()  # reset by each tile's last split
        assert torch.equal(_run(x, weight, None, (16, 64, 128, split, 4, 3), counters), first)
        _close(first, one, torch.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_rows_of_x_give_the_bias(device, fmt):
    weight = _weight(37, 200, device, 3, fmt)
    bias = _randn((37,), torch.float32, device, 4)
    x = _randn((20, 200), torch.float32, device, 5)
    x[[0, 7, 19]] = 0.0
    y = _run(x, weight, bias, (16, 64, 64, 2, 4, 3))
    assert torch.equal(y[[0, 7, 19]], bias.expand(3, -1))
    assert y.isfinite().all()
    assert torch.equal(_run(torch.zeros(20, 200, device=device), weight, None, None), torch.zeros(20, 37, device=device))


def test_bad_weights_and_configs_are_refused(device):
    x = _randn((16, 200), torch.float32, device)
    y = torch.empty(16, 8, device=device)
    int4 = quantize_weight(_randn((8, 200), torch.float32, device), "int4")
    with pytest.raises(ValueError, match="launch_w8a8 takes an int8 or fp8 weight, got int4"):
        qw.launch_w8a8(x, int4, None, y)
    with pytest.raises(ValueError, match="BLOCK_K=128 must be a multiple of 32 dividing the row's 192 bytes"):
        qw.launch_w8a8(x[:, :130], _weight(8, 130, device), None, y, config=(16, 64, 128, 1, 4, 3))
    with pytest.raises(ValueError, match="BLOCK_K=96 must be a multiple of 32 dividing the row's 256 bytes"):
        qw.launch_w8a8(x, _weight(8, 200, device, fmt="int8"), None, y, config=(16, 64, 96, 1, 4, 3))


# --------------------------------------------------------------------------------------------
# The rule and the dispatch
# --------------------------------------------------------------------------------------------

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}


@pytest.mark.parametrize("m", [16, 17, 32, 64, 128, 256, 512, 4096])
def test_the_rule_fills_the_sms_with_configs_that_fit(m):
    sms = 132
    for n, k in LLAMA3_8B.values():
        kp = 4 * packed_words(k, "fp8")
        assert kp == 4 * packed_words(k, "int8")  # one byte an element: one rule for both
        block_m, block_n, block_k, split_k, num_warps, num_stages = qw.w8a8_config(m, n, kp, sms)
        assert block_m == min(qw.MAX_BLOCK_M, max(16, 1 << (m - 1).bit_length()))
        assert block_n in qw.BLOCK_NS and block_n * block_m <= qw.MAX_ACCUMULATORS
        assert split_k in (1, 2, 4, 8) and kp % block_k == 0 and kp // block_k >= split_k
        assert num_warps == (8 if block_n * block_m >= 8192 else 4)
        assert qw.w8a8_shared_bytes(block_m, block_n, block_k, num_stages) <= qw.SHARED_BUDGET
        assert cdiv(m, block_m) * cdiv(n, block_n) * split_k >= 0.7 * sms  # about a wave or more
        if m >= 256:
            assert (block_m, block_n) == (128, 128)  # prefill: the largest tile (fewest bytes a product)


def _path(monkeypatch):
    taken = []
    for name in ("_launch_gemv", "launch_gemm", "launch_w8a8"):
        launch = getattr(ql, name)
        monkeypatch.setattr(ql, name, lambda *a, _n=name, _l=launch, **kw: taken.append(_n) or _l(*a, **kw))
    dequantize_dense = ql.dequantize
    monkeypatch.setattr(ql, "dequantize", lambda *a: taken.append("dequantize") or dequantize_dense(*a))
    return taken


@pytest.mark.parametrize("m, fmt, path", [
    *((rows, fmt, "launch_w8a8") for fmt in FORMATS for rows in (ql.W8A8_MIN_ROWS, ql.W8A8_MIN_ROWS + 1,
                                                                 ql.FUSED_MAX_ROWS + 1)),  # prefill too
    *((rows, fmt, path) for fmt in FORMATS for rows, path in ((ql.W8A8_MIN_ROWS - 1, "launch_gemm"),
                                                              (1, "_launch_gemv"))),
    (ql.W8A8_MIN_ROWS, "int4", "launch_gemm"),  # weight-only at every row count
])
def test_quantized_linear_takes_w8a8_for_8bit_weights_from_its_row_count(device, monkeypatch, m, fmt, path):
    taken = _path(monkeypatch)
    weight = quantize_weight(_randn((24, 130), torch.float32, device, 1) * 0.1, fmt)
    x = _randn((m, 130), torch.bfloat16, device, 2)
    bias = _randn((24,), torch.bfloat16, device, 3)
    y = quantized_linear(x.view(1, m, 130), weight, bias)
    assert taken == [path] and y.shape == (1, m, 24)
    if path == "launch_w8a8":
        _close(y[0], _expected(x, weight, bias), torch.bfloat16, scale=4.0, fmt=fmt)
    # The engine's eager reference takes x's rounding at the same row counts.
    _close(y, reference_quant.quantized_linear(x.view(1, m, 130), weight, bias), torch.bfloat16, scale=4.0, fmt=fmt)


@pytest.mark.parametrize("fmt, large, path", [
    ("fp8", True, "launch_w8a8"), ("fp8", False, "_launch_gemv"),
    ("int8", True, "_launch_gemv"),  # int8 at one row: the int8-dot GEMV from its own threshold, else weight-only
    ("int4", True, "_launch_gemv"),
])
def test_one_row_of_a_large_fp8_weight_runs_w8a8(device, monkeypatch, fmt, large, path):
    # The size threshold lowered (or just missed) so that a small weight counts as large or not.
    monkeypatch.setattr(ql, "W8A8_ONE_ROW_MIN_WEIGHTS", 24 * 256 + (0 if large else 1))
    taken = _path(monkeypatch)
    weight = quantize_weight(_randn((24, 256), torch.float32, device, 1) * 0.1, fmt)
    x = _randn((1, 256), torch.bfloat16, device, 2)
    y = quantized_linear(x, weight)
    assert taken == [path] and y.shape == (1, 24)
    assert ql.runs_w8a8(1, weight) == (path == "launch_w8a8")
    if path == "launch_w8a8":
        expected = _expected(x, weight, None)  # x rounded to the weight's format
    else:
        expected = x.double().cpu() @ dequantize(weight).cpu().t()
    _close(y, expected, torch.bfloat16, scale=4.0, fmt=fmt)
    # The engine's eager reference rounds x at one row exactly when the kernels do.
    codes, scales = reference_quant.quantize_activations(x, fmt)
    rounded = torch.nn.functional.linear(codes.float() * scales[:, None],
                                         reference_quant.dequantize(weight, torch.float32))
    assert torch.equal(reference_quant.quantized_linear(x, weight), rounded.to(x.dtype)) == (path == "launch_w8a8")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_linear_checks_its_inputs_before_the_w8a8_path(device, fmt):
    weight = _weight(24, 130, device, fmt=fmt)
    x = _randn((ql.W8A8_MIN_ROWS, 130), torch.float32, device)
    with pytest.raises(ValueError, match=r"x's last dim must equal weight's in_features \(130\)"):
        quantized_linear(x[:, :129], weight)
    with pytest.raises(ValueError, match=r"bias must be a \(24,\) torch.float32 tensor"):
        quantized_linear(x, weight, torch.zeros(23, device=device))
    with pytest.raises(ValueError, match="weight.data has"):
        quantized_linear(x, weight._replace(data=weight.data[:, :-16].contiguous()))
    with pytest.raises(TypeError, match=rf"weight.scales must be one of \(torch.float32,\) for {fmt}"):
        quantized_linear(x, weight._replace(scales=weight.scales.half()))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_gpu_rounds_x_as_torch_and_split_k_repeats_itself(fmt):
    # The compiled path converts with the hardware's rounding (the interpreter's e4m3 is replaced):
    # bit-exact codes, and split-K's tickets on an 8B projection give the same bits every call.
    x = (_randn((64, 4096), torch.float32, "cuda", 1) * torch.logspace(-3, 2, 64)[:, None].cuda()).bfloat16()
    _assert_quantized_as_torch(x, 4096, fmt)
    if fmt == "fp8":
        row = torch.cat([FP8_VALUES, (FP8_VALUES[1:] + FP8_VALUES[:-1]) / 2])[None, :].cuda()
    else:
        row = _int8_ties_row()[None, :].cuda()
    _assert_quantized_as_torch(row, 4 * packed_words(row.shape[1], fmt), fmt)
    weight = _weight(4096, 4096, "cuda", fmt=fmt)
    one = _run(x, weight, None, (64, 128, 128, 1, 8, 4))
    _close(one, _expected(x, weight, None), torch.bfloat16, scale=4.0, fmt=fmt)
    for split in (2, 4, 8):
        first = _run(x, weight, None, (64, 128, 128, split, 8, 4))
        for _ in range(20):
            assert torch.equal(_run(x, weight, None, (64, 128, 128, split, 8, 4)), first)
        _close(first, one, torch.bfloat16)
    # The rule's pick here splits K (64 rows, 4096 x 4096): its counters' memset and both kernels in a graph.
    assert qw.w8a8_config(64, 4096, 4096, torch.cuda.get_device_properties(0).multi_processor_count)[3] > 1
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        eager = quantized_linear(x, weight)
        with torch.cuda.graph(graph, stream=stream):
            captured = quantized_linear(x, weight)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("m", [9, 12, 15, 17, 20, 33, 47, 130])
def test_a_batch_and_the_graph_bucket_that_pads_it_take_one_config(m):
    bucket = bucket_for(m, default_buckets(256))
    for n, k in [*LLAMA3_8B.values(), (64, 128)]:  # the last split K at 20 rows, not at 24, before
        kp = 4 * packed_words(k, "fp8")
        assert qw.w8a8_config(m, n, kp, 132) == qw.w8a8_config(bucket, n, kp, 132)


def test_fp8_rows_do_not_change_when_a_graph_bucket_pads_the_batch(device):
    # 20 rows and 24 once split K in two and once not: fp8's fp32 sums then rounded differently.
    torch.manual_seed(0)
    weight = quantize_weight(torch.randn(64, 128, device=device), "fp8")
    x = torch.randn(32, 128, device=device)
    for m, buckets in ((20, (24, 32)), (ql.W8A8_MIN_ROWS, (16,)), (15, (16,))):
        rows = quantized_linear(x[:m].contiguous(), weight)
        for bucket in buckets:
            assert torch.equal(quantized_linear(x[:bucket].contiguous(), weight)[:m], rows), (m, bucket)


def test_every_graph_bucket_runs_the_product_of_the_batches_it_replays():
    """A batch replayed from a CUDA graph captured at a larger bucket takes W8A8 (x rounded) exactly when the
    same batch run without graphs does: otherwise the two modes compute different products."""
    for fmt in FORMATS:
        weight = quantize_weight(torch.randn(24, 64), fmt)
        for max_batch in (12, 16, 20, 64, 256):
            for batch in range(1, max_batch + 1):
                bucket = bucket_for(batch, default_buckets(max_batch))
                assert ql.runs_w8a8(batch, weight) == ql.runs_w8a8(bucket, weight), (fmt, max_batch, batch)
