"""The packed layout and the quantizers: where each code lands, and the reconstruction error each
format promises (symmetric round-to-nearest: half a step of its scale)."""

import pytest
import torch

from fuselab.kernels import quantize_weight
from fuselab.kernels.quant_pack import FP8_MAX, pack_codes, packed_words, scales_shape
from fuselab.kernels.reference_quant import dequantize, unpack_codes


def _weights(n, k, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    w[0] = 0.0  # an all-zero row: scale 0, nothing divided by it
    w[1, : k // 2] *= 1e-3  # small groups next to large ones
    w[2, 3] = 0.5  # an outlier sets its group's scale
    return w


def test_code_j_of_word_i_is_element_16j_plus_i_of_its_block():
    codes = torch.arange(256).remainder(16).view(1, 256)
    words = pack_codes(codes, "int4")
    assert words.shape == (1, 32) and words.dtype == torch.int32
    u = words.to(torch.int64) & 0xFFFFFFFF
    for block in range(2):
        for i in range(16):
            for j in range(8):
                assert (u[0, 16 * block + i] >> (4 * j)) & 0xF == codes[0, 128 * block + 16 * j + i]
    byte_codes = torch.arange(64).view(1, 64) * 3 + 7
    u = pack_codes(byte_codes, "int8").to(torch.int64) & 0xFFFFFFFF
    assert all((u[0, i] >> (8 * j)) & 0xFF == byte_codes[0, 16 * j + i] for i in range(16) for j in range(4))


@pytest.mark.parametrize("fmt, k, words", [("int4", 1, 16), ("int4", 128, 16), ("int4", 129, 32), ("int8", 64, 16),
                                            ("fp8", 65, 32)])
def test_rows_pad_to_whole_blocks_with_the_code_of_zero(fmt, k, words):
    assert packed_words(k, fmt) == words
    w = quantize_weight(torch.ones(3, k), fmt)
    assert w.data.shape == (3, words) and w.in_features == k
    padded = w._replace(in_features=words * (8 if fmt == "int4" else 4))
    assert (dequantize(padded)[:, k:] == 0).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_is_within_half_a_step_of_its_group_scale(group):
    w = _weights(40, 300)
    q = quantize_weight(w, "int4", group)
    assert q.scales.dtype == torch.bfloat16 and q.scales.shape == scales_shape(40, 300, "int4", group)
    codes = unpack_codes(q)
    assert codes.min() >= 0 and codes.max() <= 15
    step = q.scales.double().repeat_interleave(group, dim=1)[:, :300]
    error = (dequantize(q) - w.double()).abs()
    assert (error <= 0.5 * step * (1 + 1e-6) + 1e-12).all()
    # Each group's largest weight is in range: amax / scale <= 7.5 (the scale is rounded up).
    padded = torch.zeros(40, q.scales.shape[1] * group)
    padded[:, :300] = w
    amax = padded.abs().view(40, -1, group).amax(dim=-1)
    assert (amax <= 7.5 * q.scales.float()).all()
    assert (dequantize(q)[0] == 0).all()


def test_int8_is_within_half_a_step_of_its_channel_scale():
    w = _weights(40, 300)
    q = quantize_weight(w, "int8")
    assert q.scales.dtype == torch.float32 and q.scales.shape == (40,)
    assert torch.allclose(q.scales.double(), w.abs().amax(dim=1).double() / 127)
    error = (dequantize(q) - w.double()).abs()
    assert (error <= 0.5 * q.scales.double()[:, None] * (1 + 1e-6) + 1e-12).all()
    assert unpack_codes(q).min() >= 1  # q in [-127, 127]: symmetric, code 0 (-128) unused


def test_fp8_keeps_three_mantissa_bits_of_each_weight():
    w = _weights(40, 300)
    q = quantize_weight(w, "fp8")
    assert torch.allclose(q.scales.double(), w.abs().amax(dim=1).double() / FP8_MAX)
    relative = w.double() / q.scales.double().clamp_min(1e-30)[:, None]
    error = (dequantize(q) - w.double()).abs() / q.scales.double().clamp_min(1e-30)[:, None]
    # Round to nearest: half a unit in the last place, 2^-4 of the value for normals, 2^-10 below 2^-6.
    assert (error <= torch.maximum(relative.abs() * 2**-4, torch.full_like(relative, 2**-10)) + 1e-9).all()
    assert dequantize(q).abs().max() <= w.abs().max() * (1 + 1e-6)


def test_quantize_rejects_what_it_cannot_pack():
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_weight(torch.ones(2, 2), "int2")
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_weight(torch.ones(2, 2), "int4", 100)
    with pytest.raises(ValueError, match="weight must be a 2-D float tensor"):
        quantize_weight(torch.ones(2, 2, 2), "int8")


def test_quantizing_in_row_chunks_matches_one_chunk(monkeypatch):
    from fuselab.kernels import quant_pack

    w = _weights(50, 200, seed=3)
    whole = quantize_weight(w, "int4", 64)
    monkeypatch.setattr(quant_pack, "_ROWS_PER_CHUNK", 16)
    chunked = quantize_weight(w, "int4", 64)
    assert torch.equal(whole.data, chunked.data) and torch.equal(whole.scales, chunked.scales)
