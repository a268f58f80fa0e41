"""The quantized linear kernels (GEMV, tensor-core GEMM, dequantize + cuBLAS) against a float64
dequantization of the same packed weight, at odd shapes, in every activation dtype."""

import pytest
import torch
from kernel_checks import DTYPES, assert_close, kernel_module

from fuselab.kernels import QuantizedWeight, quantize_weight, quantized_linear
from fuselab.kernels.quant_pack import block_elements, pack_codes
from fuselab.kernels import reference_quant
from fuselab.kernels.reference_quant import dequantize

ql = kernel_module("quantized_linear")
qg = kernel_module("quantized_gemm")
FORMATS = [("int4", 128), ("int4", 64), ("int4", 32), ("int8", 0), ("fp8", 0)]


def _randn(shape, dtype, device, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _weight(fmt, group, n, k, device, seed=0):
    return quantize_weight(_randn((n, k), torch.float32, device, seed) * k**-0.5, fmt, group or 128)


def _check(x, weight, bias=None, out=None):
    got = quantized_linear(x, weight, bias, out=out)
    expected = x.double() @ dequantize(weight).t()
    if bias is not None:
        expected += bias.double()
    assert got.shape == (*x.shape[:-1], weight.out_features) and got.dtype == x.dtype
    # The kernels multiply exact codes by x in fp32: the reference differs only in summation order
    # (and, for half-precision x, in the rounding of the output).
    assert_close(got, expected, x.dtype, scale=4.0)
    return got


def _path(monkeypatch):
    """Which launcher quantized_linear takes, as a list filled by the call."""
    taken = []
    for name in ("_launch_gemv", "launch_gemm", "launch_gemv_a8"):
        launch = getattr(ql, name)
        monkeypatch.setattr(ql, name, lambda *a, _n=name, _l=launch, **kw: taken.append(_n) or _l(*a, **kw))
    dequantize_dense = ql.dequantize
    monkeypatch.setattr(ql, "dequantize", lambda *a: taken.append("dequantize") or dequantize_dense(*a))
    return taken


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt, group", FORMATS)
@pytest.mark.parametrize("n, k", [(37, 200), (8, 128), (21, 67)])
def test_one_row_runs_the_gemv(device, monkeypatch, fmt, group, dtype, n, k):
    taken = _path(monkeypatch)
    _check(_randn((1, k), dtype, device, k), _weight(fmt, group, n, k, device, n))
    assert taken == ["_launch_gemv"]


@pytest.mark.parametrize("fmt, group, dtype, runs_a8", [
    ("int4", 128, torch.bfloat16, True), ("int4", 128, torch.float16, True), ("int4", 128, torch.float32, True),
    ("int4", 64, torch.bfloat16, False), ("int4", 32, torch.float32, False), ("int8", 0, torch.bfloat16, True),
    ("fp8", 0, torch.bfloat16, False)])
def test_one_row_of_a_large_weight_runs_the_int8_dot_gemv(device, monkeypatch, fmt, group, dtype, runs_a8):
    # The size threshold lowered so that a small weight counts as large; int8 and int4 in groups of 128 cross
    # it, and then x is rounded to int8 (a float64 reference of the rounded x).
    monkeypatch.setattr(ql, "A8_MIN_WEIGHTS", 37 * 200)
    taken = _path(monkeypatch)
    x, weight = _randn((1, 200), dtype, device, 5), _weight(fmt, group, 37, 200, device, 6)
    if runs_a8:
        codes, scales = reference_quant.quantize_activations(x, "int8")
        expected = (codes.double() * scales.double()[:, None]) @ dequantize(weight).t()
        assert_close(quantized_linear(x, weight), expected, dtype, scale=4.0)
        assert ql.rounds_x(1, weight) == "int8"
    else:
        _check(x, weight)
    assert taken == (["launch_gemv_a8"] if runs_a8 else ["_launch_gemv"])
    taken.clear()
    monkeypatch.setattr(ql, "A8_MIN_WEIGHTS", 37 * 200 + 1)
    _check(x, weight)
    assert taken == ["_launch_gemv"] and ql.rounds_x(1, weight) is None


@pytest.mark.parametrize("fmt, group", FORMATS)
def test_the_gemv_steps_several_runs_and_masks_a_partial_last_block(device, monkeypatch, fmt, group):
    # One block a run: a 5-block row (one of them partial) takes 5 runs, the last re-reading itself.
    monkeypatch.setattr(ql, "GEMV_MAX_RUN_BLOCKS", 1)
    ql.gemv_config.cache_clear()
    try:
        k = 4 * ql.block_elements(fmt) + 9
        _check(_randn((1, k), torch.float32, device, 1), _weight(fmt, group, 19, k, device, 2),
               _randn((19,), torch.float32, device, 3))
    finally:
        ql.gemv_config.cache_clear()


@pytest.mark.parametrize("fmt, group", FORMATS)
def test_a_gemv_program_walks_several_tiles_and_runs(device, fmt, group):
    # One program (programs per SM 1, on a one-SM grid at most 4): 19 rows in 2-row tiles, each of
    # several one-block runs, the last tile partial; bias and a row not a multiple of the block.
    k = 3 * ql.block_elements(fmt) + 5
    x, weight, bias = (_randn((1, k), torch.float32, device, 5), _weight(fmt, group, 19, k, device, 6),
                       _randn((19,), torch.float32, device, 7))
    for config in ((2, 1, 1, 1), (4, 1, 1, 2), (8, 2, 1, 1)):
        y = torch.empty(1, 19, device=device)
        ql._launch_gemv(x, weight, bias, y, config=config)
        assert_close(y, x.double() @ dequantize(weight).t() + bias.double(), torch.float32, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt, group", FORMATS)
@pytest.mark.parametrize("m", [2, 5, 17])
def test_several_rows_run_the_tensor_core_kernel(device, monkeypatch, fmt, group, dtype, m):
    monkeypatch.setattr(ql, "W8A8_MIN_ROWS", ql.FUSED_MAX_ROWS + 1)  # int8's and fp8's W8A16 kernel (W8A8: test_quant_gemm_w8a8)
    taken = _path(monkeypatch)
    _check(_randn((m, 200), dtype, device, m), _weight(fmt, group, 37, 200, device, 4))
    assert taken == ["launch_gemm"]


@pytest.mark.parametrize("fmt, group", FORMATS)
def test_tensor_core_tiles_over_rows_of_x_and_w(device, monkeypatch, fmt, group):
    # 70 rows of x at 128 a program, 40 rows of W at 64 a program: partial tiles on both sides.
    monkeypatch.setattr(ql, "W8A8_MIN_ROWS", ql.FUSED_MAX_ROWS + 1)  # int8's and fp8's W8A16 kernel
    x = _randn((70, 130), torch.float32, device, 1)
    weight = _weight(fmt, group, 40, 130, device, 2)
    _check(x, weight, _randn((40,), torch.float32, device, 3))
    assert qg.gemm_config(70, 40, weight.data.shape[1], fmt, 132, 4)[:2] == (128, 64)
    assert qg.gemm_config(5, 40, weight.data.shape[1], fmt, 132)[3] > 1  # one tile of W: split-K fills SMs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt, group", [("int4", 32), ("int8", 0), ("fp8", 0)])
def test_many_rows_dequantize_once_then_run_cublas(device, monkeypatch, fmt, group, dtype):
    monkeypatch.setattr(ql, "FUSED_MAX_ROWS", 4)
    taken = _path(monkeypatch)
    weight = _weight(fmt, group, 33, 150, device, 5)
    _check(_randn((7, 150), dtype, device, 6), weight, _randn((33,), dtype, device, 7))  # under W8A8_MIN_ROWS
    assert taken == ["dequantize"]
    assert_close(ql.dequantize(weight, torch.float32), dequantize(weight), torch.float32)


def test_leading_dims_bias_and_out(device):
    weight = _weight("int4", 128, 24, 256, device)
    x = _randn((2, 1, 256), torch.bfloat16, device, 1)
    bias = _randn((24,), torch.bfloat16, device, 2)
    out = torch.empty(2, 1, 24, dtype=torch.bfloat16, device=device)
    assert _check(x, weight, bias, out=out) is out
    one = _randn((1, 256), torch.float16, device, 3)
    out = torch.empty(1, 24, dtype=torch.float16, device=device)
    assert _check(one, weight, out=out) is out


def test_non_contiguous_x_and_empty_inputs(device):
    weight = _weight("int8", 0, 16, 64, device)
    _check(_randn((3, 128), torch.float32, device, 1)[:, ::2], weight)
    assert quantized_linear(torch.empty(0, 64, device=device), weight).shape == (0, 16)


@pytest.mark.parametrize("fmt, levels", [("int4", 16), ("int8", 256)])
def test_every_code_in_every_place_of_a_word(device, fmt, levels):
    """Codes read where they lie in the word or from its high half: each value at each position."""
    block = block_elements(fmt)
    codes = torch.arange(levels * block, device=device).remainder(levels).view(-1, block)
    codes = torch.cat([codes, codes.roll(1, dims=1)])  # each value at every code position j of a word
    scales = (torch.ones(codes.shape[0], 1, dtype=torch.bfloat16, device=device) if fmt == "int4"
              else torch.ones(codes.shape[0], device=device))
    weight = QuantizedWeight(pack_codes(codes, fmt), scales, fmt, 128 if fmt == "int4" else 0, block)
    eye = torch.eye(block, device=device)
    _check(eye[:1], weight)
    _check(eye, weight)


@pytest.mark.parametrize("make, error, match", [
    (lambda x, w: (x, w.data), TypeError, "weight must be a QuantizedWeight"),
    (lambda x, w: (x.to(torch.int32), w), TypeError, "x must be float32"),
    (lambda x, w: (x[:, :-1], w), ValueError, r"x's last dim must equal weight's in_features \(64\)"),
    (lambda x, w: (x, w._replace(fmt="int3")), ValueError, "fmt must be one of"),
    (lambda x, w: (x, w._replace(group_size=48)), ValueError, "group_size must be one of"),
    (lambda x, w: (x, w._replace(data=w.data[:, :8].contiguous())), ValueError, "weight.data has 8 words a row"),
    (lambda x, w: (x, w._replace(data=w.data.to(torch.int64))), ValueError, "weight.data must be a contiguous 2-D int32"),
    (lambda x, w: (x, w._replace(scales=w.scales[:-1])), ValueError, r"weight.scales must have shape \(8, 4\)"),
    (lambda x, w: (x, w._replace(scales=w.scales.to(torch.int8))), TypeError, "weight.scales must be one of"),
    (lambda x, w: (x, w._replace(counters=torch.zeros(4, device=w.data.device))), ValueError,
     "weight.counters must be None or a contiguous 1-D int32 tensor"),
    (lambda x, w: (x, w._replace(counters=torch.zeros(2, 2, dtype=torch.int32, device=w.data.device))), ValueError,
     "weight.counters must be None or a contiguous 1-D int32 tensor"),
])
def test_bad_inputs_name_the_argument(device, make, error, match):
    weight = _weight("int4", 32, 8, 64, device)
    x, w = make(_randn((1, 64), torch.float32, device), weight)
    with pytest.raises(error, match=match):
        quantized_linear(x, w)


def test_bad_bias_and_out_name_the_argument(device):
    weight = _weight("fp8", 0, 8, 64, device)
    x = _randn((2, 64), torch.float32, device)
    with pytest.raises(ValueError, match=r"bias must be a \(8,\) torch.float32 tensor"):
        quantized_linear(x, weight, torch.zeros(8, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match=r"out must be a contiguous \(2, 8\) torch.float32 tensor"):
        quantized_linear(x, weight, out=torch.empty(2, 9, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, group", FORMATS)
def test_every_path_is_captured_by_a_cuda_graph(fmt, group):
    weight = _weight(fmt, group, 4096, 4096, "cuda")
    for m in (1, 8, 300):
        x = _randn((m, 4096), torch.bfloat16, "cuda", m)
        eager = quantized_linear(x, weight)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            quantized_linear(x, weight)  # compiles outside the capture
            with torch.cuda.graph(graph, stream=stream):
                captured = quantized_linear(x, weight)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, eager)
