"""The one-row int8-dot GEMV (quantized_gemv_a8): x rounded per row to int8, against float64 products of
the same codes, at odd shapes, every activation dtype and launch configs that walk several runs and tiles."""

import pytest
import torch
from kernel_checks import DTYPES, assert_close, kernel_module

from fuselab.kernels import quantize_weight
from fuselab.kernels.reference_quant import dequantize, quantize_activations

qa = kernel_module("quantized_gemv_a8")
qw = kernel_module("quantized_gemm_w8a8")
FORMATS = [("int4", 128), ("int8", 0)]


def _randn(shape, dtype, device, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _weight(fmt, group, n, k, device, seed=0):
    return quantize_weight(_randn((n, k), torch.float32, device, seed) * k**-0.5, fmt, group or 128)


def _expected(x, weight, bias=None):
    """float64 products of what the kernel multiplies: x's int8 codes times their scale, and W."""
    codes, scales = quantize_activations(x, "int8")
    y = (codes.double() * scales.double()[:, None]) @ dequantize(weight).t()
    return y if bias is None else y + bias.double()


def _run(x, weight, bias=None, config=None):
    y = torch.empty(1, weight.out_features, device=x.device, dtype=x.dtype)
    qa.launch_gemv_a8(x, weight, bias, y, config=config)
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt, group", FORMATS)
@pytest.mark.parametrize("n, k", [(37, 200), (8, 128), (21, 67), (5, 1000)])
def test_one_row_matches_the_rounded_x_reference(device, fmt, group, dtype, n, k):
    weight = _weight(fmt, group, n, k, device, n)
    x = _randn((1, k), dtype, device, k)
    bias = _randn((n,), dtype, device, 3)
    assert_close(_run(x, weight, bias), _expected(x, weight, bias), dtype, scale=4.0)


@pytest.mark.parametrize("fmt, group", FORMATS)
@pytest.mark.parametrize("config", [(4, 1, 1, 1), (2, 2, 1, 2), (8, 4, 1, 1)])
def test_configs_walk_several_runs_and_tiles(device, fmt, group, config):
    # 21 rows and 4 blocks a row: runs of 1-4 blocks, a program walking several tiles, a partial last tile.
    k = 4 * 16 * (8 if fmt == "int4" else 4)
    weight = _weight(fmt, group, 21, k, device, 7)
    x = _randn((1, k), torch.float32, device, 8)
    assert_close(_run(x, weight, config=config), _expected(x, weight), torch.float32, scale=4.0)


@pytest.mark.parametrize("fmt, group", FORMATS)
@pytest.mark.parametrize("config", [(4, 32, 2, 1), (4, 8, 1, 2)])
def test_the_rules_long_and_short_runs_walk_a_row_of_64_blocks(device, fmt, group, config):
    # gemv_a8_config's runs of 32 blocks at two warps (int8's down projections) and of 8 at one warp (the 8B
    # q/k/v): 9 rows of 64 blocks, two runs or eight a row, a partial last tile.
    k = 64 * 16 * (8 if fmt == "int4" else 4)
    weight = _weight(fmt, group, 9, k, device, 9)
    x = _randn((1, k), torch.float32, device, 10)
    assert_close(_run(x, weight, config=config), _expected(x, weight), torch.float32, scale=4.0)


def test_every_code_of_an_int4_word_meets_its_element(device):
    # One weight row whose codes run through every value -8..7 at every position of a block, x a ramp:
    # any mix-up of code positions or of the nibbles' order changes the product.
    k = 256
    q = (torch.arange(k) % 16 - 8).double()
    w = (q * 0.01).view(1, k).float()
    weight = quantize_weight(w.to(device), "int4", 128)
    x = torch.linspace(-1, 1, k).view(1, k).to(device)
    assert_close(_run(x, weight), _expected(x, weight), torch.float32, scale=4.0)


def test_int4_order_of_x_codes(device):
    # quantize_rows' "int4" order: byte b of a 128-byte block is element 32·(b % 4) + 16·((b % 128) // 64)
    # + (b % 64) // 4 of that block.
    k = 200
    x = _randn((1, k), torch.float32, device, 1)
    codes, scale = qw.quantize_rows(x, 256, "int4")
    ref_codes, ref_scale = quantize_activations(x, "int8")
    b = torch.arange(256)
    src = (b // 128) * 128 + (b % 4) * 32 + ((b % 128) // 64) * 16 + (b % 64) // 4
    expected = torch.where(src < k, ref_codes.cpu()[0, src.clamp(max=k - 1)], torch.zeros((), dtype=torch.int8))
    assert torch.equal(codes.cpu()[0], expected)
    assert torch.equal(scale.cpu(), ref_scale.cpu())


@pytest.mark.parametrize("fmt, group", FORMATS)
def test_an_all_zero_row_gives_the_bias(device, fmt, group):
    weight = _weight(fmt, group, 9, 128, device)
    bias = _randn((9,), torch.float32, device, 2)
    assert torch.equal(_run(torch.zeros(1, 128, device=device), weight, bias).cpu(), bias.cpu().view(1, 9))


@pytest.mark.parametrize("fmt, group, rows", [("int4", 64, 1), ("int4", 32, 1), ("fp8", 0, 1), ("int8", 0, 2)])
def test_refuses_what_it_does_not_take(device, fmt, group, rows):
    weight = _weight(fmt, group, 9, 128, device)
    x = torch.randn(rows, 128, device=device)
    assert not qa.runs_a8(rows, weight)
    with pytest.raises(ValueError, match="launch_gemv_a8 takes one row and an int8 or int4-g128 weight"):
        qa.launch_gemv_a8(x, weight, None, torch.empty(rows, 9, device=device))


def test_int8_rows_too_long_for_exact_int32_sums_are_not_taken(device):
    weight = quantize_weight(torch.zeros(2, qa.A8_INT8_MAX_K + 1, device=device), "int8")
    assert not qa.runs_a8(1, weight)
    assert qa.runs_a8(1, quantize_weight(torch.zeros(2, qa.A8_INT8_MAX_K, device=device), "int8"))


def test_config_rule_divides_the_row():
    for n in (9, 4096, 28672):
        for fmt in ("int4", "int8"):
            for n_words in (16, 48, 512, 1792, 2048, 3584):
                for sms in (1, 132):
                    block_n, block_b, warps, per_sm = qa.gemv_a8_config(n, n_words, fmt, sms)
                    assert (n_words // 16) % block_b == 0 and block_b <= 2 * qa.A8_MAX_RUN_BLOCKS
                    assert 1 <= warps <= 2 and per_sm in (qa.A8_PROGRAMS_PER_SM, 2 * qa.A8_PROGRAMS_PER_SM)


def test_config_rule_takes_more_programs_where_tiles_outnumber_them():
    # The 8B q/k/v (6144 rows, 1536 tiles of 4) outnumber 8 programs an SM on 132 SMs, not on 512.
    assert qa.gemv_a8_config(6144, 512, "int4", 132) == (4, 8, 1, 16)
    assert qa.gemv_a8_config(6144, 512, "int4", 512) == (4, 16, 2, 8)
    assert qa.gemv_a8_config(6144, 1024, "int8", 132) == (4, 16, 2, 16)
    # int8's long rows (the 8B down: 224 blocks) take runs of 32; int4's (112 blocks) cannot.
    assert qa.gemv_a8_config(4096, 3584, "int8", 132) == (4, 32, 2, 8)
    assert qa.gemv_a8_config(4096, 1792, "int4", 132) == (4, 16, 2, 8)
    assert qa.gemv_a8_config(28672, 1024, "int8", 132) == (8, 8, 1, 16)
