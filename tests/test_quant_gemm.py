"""quantized_gemm's tensor-core kernels at explicit configs (split-K on and off, steps spanning blocks
and scale groups, partial tiles on every side) against a float64 dequantization, int4's operand
against dequantize(w, x.dtype) exactly, its split-K counters, and gemm_config's rule on the Llama 3
8B projections."""

import pytest
import torch
from kernel_checks import assert_close, kernel_module

from fuselab.kernels import quantize_weight
from fuselab.kernels._common.launch import cdiv
from fuselab.kernels._common.validate import INTERPRETED
from fuselab.kernels.quant_pack import packed_words
from fuselab.kernels.reference_quant import dequantize

qg = kernel_module("quantized_gemm")
FORMATS = [("int4", 128), ("int4", 64), ("int4", 32), ("int8", 0), ("fp8", 0)]
# (m, n, k, (BLOCK_M, BLOCK_N, BLOCK_W, SPLIT_K, warps, stages), x dtype, bias). Every K ends in a
# partial block. Steps a row (int4 / 8-bit): k=200 at 16 words 2 / 4, at 32 words 1 / 2; k=500 at 32
# words 2 / 4, at 64 words 1 / 2; k=600 at 16 words 5 / 10.
CASES = [
    (2, 37, 200, (16, 64, 16, 1, 4, 3), torch.float32, True),  # one split: y stored directly
    (3, 37, 500, (16, 64, 32, 2, 4, 3), torch.bfloat16, False),  # steps of two blocks (int4: several groups)
    (17, 70, 600, (32, 64, 16, 3, 4, 3), torch.float16, True),  # 3 splits of 5 or 10 steps; 2 tiles of W
    (65, 37, 500, (16, 128, 64, 4, 8, 2), torch.float32, True),  # 5 tiles of x; splits left with no step
    (65, 37, 200, (128, 256, 32, 2, 8, 3), torch.bfloat16, True),  # tiles wider than x and W
]


def _randn(shape, dtype, device, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _weight(fmt, group, n, k, device, seed=0):
    return quantize_weight(_randn((n, k), torch.float32, device, seed) * k**-0.5, fmt, group or 128)


def _run(x, weight, bias, config, counters=None):
    y = torch.full((x.shape[0], weight.out_features), float("nan"), dtype=x.dtype, device=x.device)
    qg.launch_gemm(x, weight, bias, y, config=config, counters=counters)
    expected = x.double() @ dequantize(weight).t()
    if bias is not None:
        expected += bias.double()
    # int4's operand is code · scale rounded to x's dtype, as dequantize(w, x.dtype) is; the rest is
    # summation order and the output's rounding (the tolerance of tests/test_quant_kernels.py).
    assert_close(y, expected, x.dtype, scale=4.0)
    return y


@pytest.mark.parametrize("m, n, k, config, dtype, with_bias", CASES)
@pytest.mark.parametrize("fmt, group", FORMATS)
def test_every_config_matches_float64(device, fmt, group, m, n, k, config, dtype, with_bias):
    weight = _weight(fmt, group, n, k, device, m)
    bias = _randn((n,), dtype, device, 2) if with_bias else None
    _run(_randn((m, k), dtype, device, k), weight, bias, config)


# The int4 kernels past the default (launch_gemm's 7th config element), at CASES and at one more
# case: 70 rows, K = 328 (3 steps of 16 words, 2 splits).
INT4_VARIANTS = range(1, len(qg.GEMM_VARIANTS))


@pytest.mark.parametrize("m, n, k, config, dtype, with_bias",
                         CASES + [(70, 45, 328, (64, 128, 16, 2, 8, 3), torch.bfloat16, True)])
@pytest.mark.parametrize("group", [128, 64, 32])
@pytest.mark.parametrize("variant", INT4_VARIANTS)
def test_int4_kernels_match_float64(device, variant, group, m, n, k, config, dtype, with_bias):
    weight = _weight("int4", group, n, k, device, m)
    bias = _randn((n,), dtype, device, 2) if with_bias else None
    _run(_randn((m, k), dtype, device, k), weight, bias, _fitting(config, variant, dtype))


def _fitting(config, variant, dtype):
    """config for `variant` with its step shortened until the wide kernel's pipeline fits a program's
    shared memory on a GPU (its operand takes a whole step at fp32 x)."""
    block_m, block_n, block_w, split_k, num_warps, num_stages = config
    x_bytes = torch.finfo(dtype).bits // 8
    while block_w > 16 and qg.gemm_shared_bytes(block_m, block_n, block_w, "int4", num_stages, x_bytes,
                                                variant) > qg.SHARED_BUDGET:
        block_w //= 2
    return block_m, block_n, block_w, split_k, num_warps, num_stages, variant


@pytest.mark.parametrize("x_dtype, scale_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16),
                                                  (torch.bfloat16, torch.float16), (torch.float16, torch.float16),
                                                  (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("group", [128, 64, 32])
@pytest.mark.parametrize("variant", [0, *INT4_VARIANTS])
def test_int4_operand_is_dequantize_in_x_dtype_exactly(device, variant, group, x_dtype, scale_dtype):
    # x = the identity: each output is one product by 1 plus zeros, so y is the operand itself, which
    # must be dequantize(w, x.dtype) bit for bit (code · scale rounded once), every column in its place
    # (K ends in a partial block; two tiles of x; two splits). fp16 scales: GPTQ's.
    if INTERPRETED and x_dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter rounds fp32 to bf16 toward zero (a GPU rounds to nearest)")
    n, k = 37, 200
    weight = _weight("int4", group, n, k, device, 3)
    weight = weight._replace(scales=weight.scales.to(scale_dtype))
    y = torch.full((k, n), float("nan"), dtype=x_dtype, device=device)
    qg.launch_gemm(torch.eye(k, dtype=x_dtype, device=device), weight, None, y, config=(128, 64, 16, 2, 4, 3, variant))
    assert torch.equal(y, dequantize(weight, x_dtype).t())


def test_a_variant_of_another_format_is_refused(device):
    weight = _weight("int8", 0, 8, 200, device)
    with pytest.raises(ValueError, match="kernels past 0 are int4's"):
        qg.launch_gemm(_randn((2, 200), torch.float32, device), weight, None, torch.empty(2, 8, device=device),
                       config=(16, 64, 16, 1, 4, 3, 1))


@pytest.mark.parametrize("fmt, group", [("int4", 32), ("int8", 0)])
def test_split_k_leaves_its_counters_at_zero(device, fmt, group):
    # 3 tiles of x, 2 of W, 4 splits (one with two steps of the 5): each tile's last split resets its
    # counter, so the same counters serve the next call, as a CUDA graph's replay reuses them.
    m, n, k, config = 40, 70, 600, (16, 64, 16, 4, 4, 3)
    weight = _weight(fmt, group, n, k, device, 1)
    x = _randn((m, k), torch.float32, device, 2)
    counters = torch.zeros(cdiv(m, 16) * cdiv(n, 64), dtype=torch.int32, device=device)
    first = _run(x, weight, None, config, counters)
    assert counters.tolist() == [0] * counters.numel()
    second = _run(x, weight, None, config, counters)
    assert counters.tolist() == [0] * counters.numel()
    assert torch.equal(first, second)


@pytest.mark.parametrize("fmt, group", [("int4", 128), ("int8", 0)])
def test_split_k_draws_its_tickets_from_the_weights_own_counters(device, monkeypatch, fmt, group):
    # A weight that carries counters (as the engine's layers do): no fresh buffer is zeroed for the
    # call, and the counters are back at zero after it.
    m, n, k, config = 40, 70, 600, (16, 64, 16, 4, 4, 3)
    counters = torch.zeros(64, dtype=torch.int32, device=device)
    weight = _weight(fmt, group, n, k, device, 1)._replace(counters=counters)
    x = _randn((m, k), torch.float32, device, 2)
    zeros = torch.zeros
    fresh = []
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: fresh.append(kw.get("dtype")) or zeros(*a, **kw))
    _run(x, weight, None, config)
    assert torch.int32 not in fresh
    assert counters.tolist() == [0] * 64
    # Counters too few for the tiles: a fresh buffer, the weight's left alone.
    few = weight._replace(counters=torch.zeros(cdiv(m, 16) * cdiv(n, 64) - 1, dtype=torch.int32, device=device))
    _run(x, few, None, config)
    assert torch.int32 in fresh


def test_tile_counters_are_the_weights_when_it_holds_enough():
    own = torch.zeros(8, dtype=torch.int32)
    assert qg.tile_counters(own, 8, own.device) is own
    for buffer in (None, torch.zeros(7, dtype=torch.int32)):
        fresh = qg.tile_counters(buffer, 8, own.device)
        assert fresh is not buffer and fresh.dtype == torch.int32 and fresh.tolist() == [0] * 8


def test_a_step_that_does_not_divide_the_row_is_refused(device):
    weight = _weight("int4", 128, 8, 200, device)  # 32 words a row
    x = _randn((2, 200), torch.float32, device)
    with pytest.raises(ValueError, match="BLOCK_W=64 must be a multiple of 16 dividing the row's 32 words"):
        qg.launch_gemm(x, weight, None, torch.empty(2, 8, device=device), config=(16, 64, 64, 1, 4, 3))


LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("m", [2, 16, 32, 64, 128, 256])
def test_the_rule_fills_the_sms_with_configs_that_fit(fmt, m):
    sms = 132
    for n, k in LLAMA3_8B.values():
        n_words = packed_words(k, fmt)
        config = qg.gemm_config(m, n, n_words, fmt, sms)
        block_m, block_n, block_w, split_k, num_warps, num_stages = config[:6]
        variant = config[6] if fmt == "int4" else 0
        assert len(config) == (7 if fmt == "int4" else 6)
        assert block_m == min(qg.MAX_BLOCK_M, max(16, 1 << (m - 1).bit_length()))
        assert block_n in (64, 128, 256) and split_k in (1, 2, 4, 8) and num_warps in (4, 8)
        assert n_words % block_w == 0 and n_words // block_w >= split_k
        assert block_n * block_w <= qg.MAX_STEP_WORDS
        assert qg.gemm_shared_bytes(block_m, block_n, block_w, fmt, num_stages, 2, variant) <= qg.SHARED_BUDGET
        assert cdiv(m, block_m) * cdiv(n, block_n) * split_k >= 0.7 * sms  # about a wave or more


def test_the_rule_splits_the_narrow_projections_and_not_the_wide_ones():
    # 64 rows, int4: o (4096 rows of W) in 32 tiles of 128 rows, 4 splits; gate_up (28672) in 112
    # tiles of 256, whole rows; x from L2 at most twice the weight's bytes in both.
    assert qg.gemm_config(64, 4096, 512, "int4", 132) == (64, 128, 32, 4, 8, 3, qg.WIDE_INT4)
    assert qg.gemm_config(64, 28672, 512, "int4", 132) == (64, 256, 32, 1, 8, 3, qg.WIDE_INT4)
    assert len(qg.gemm_config(64, 4096, 512, "int4", 132, 4)) == 6  # fp32 x: the per-code kernel
    assert qg.gemm_config(16, 28672, 512, "int4", 132)[1] == 128  # no 256-row tiles at 16 rows
    # Up to 16 rows, more tiles of W than SMs: 32-word steps at 4 warps (gate/up, lm_head); not at
    # one wave of tiles (the 1B gate/up) nor with split-K (down).
    assert qg.gemm_config(1, 28672, 512, "int4", 132) == (16, 128, 32, 1, 4, 3, qg.WIDE_INT4)
    assert qg.gemm_config(16, 128256, 256, "int4", 132) == (16, 128, 32, 1, 4, 3, qg.WIDE_INT4)
    assert qg.gemm_config(1, 16384, 256, "int4", 132) == (16, 128, 64, 1, 8, 3, qg.WIDE_INT4)
    assert qg.gemm_config(1, 4096, 1792, "int4", 132) == (16, 128, 64, 4, 8, 3, qg.WIDE_INT4)
    assert qg.gemm_config(32, 28672, 512, "int4", 132) == (32, 256, 32, 1, 8, 3, qg.WIDE_INT4)  # past 16 rows as before
    assert qg.gemm_config(16, 4096, 1024, "int8", 132)[3] == 4
    assert qg.gemm_config(16, 128256, 1024, "int8", 132)[3] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, group", FORMATS)
def test_split_k_on_the_gpu_repeats_itself_and_one_split(fmt, group):
    # 32 tiles of 4 or 8 splits reduce at once on a GPU: a partial read before it was stored, or a
    # ticket drawn twice, would show as a call differing from the others or from the one-split sum.
    weight = _weight(fmt, group, 4096, 4096, "cuda")
    x = _randn((64, 4096), torch.bfloat16, "cuda", 1)
    one_split = _run(x, weight, None, (64, 128, 32, 1, 8, 3))
    for split in (2, 4, 8):
        counters = torch.zeros(32, dtype=torch.int32, device="cuda")
        first = _run(x, weight, None, (64, 128, 32, split, 8, 3), counters)
        for _ in range(20):
            y = torch.empty_like(first)
            qg.launch_gemm(x, weight, None, y, config=(64, 128, 32, split, 8, 3), counters=counters)
            assert torch.equal(y, first)
        assert counters.count_nonzero().item() == 0
        assert_close(first, one_split, torch.bfloat16)
