import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import DTYPES, assert_close, leaf

from fuselab.kernels import reference
from fuselab.kernels import rope as rope_module
from fuselab.kernels.rope import apply_rope
from fuselab.kernels.rope_table import rope_cos_sin

LAYOUTS = ("rotate_half", "interleaved")
MAX_POS = 64


def _qk(leading, q_heads, k_heads, head_dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*leading, q_heads, head_dim, generator=g).to(dtype).to(device)
    k = torch.randn(*leading, k_heads, head_dim, generator=g).to(dtype).to(device)
    positions = torch.randint(0, MAX_POS, leading, generator=g).to(device)
    return q, k, positions


def _check_against_reference(q, k, positions, cos_sin, layout, dtype):
    got_q, got_k = apply_rope(q, k, positions, cos_sin, layout)
    ref_q, ref_k = reference.apply_rope(q.double(), k.double(), positions, cos_sin.double(), layout)
    assert got_q.dtype == q.dtype and got_q.shape == q.shape and got_k.shape == k.shape
    assert_close(got_q, ref_q, dtype)
    assert_close(got_k, ref_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (2, 2), (80, 32), (24, 6)])
def test_forward_matches_reference(device, dtype, layout, head_dim, rotary_dim):
    q, k, positions = _qk((5,), 3, 1, head_dim, dtype, device)
    cos_sin = rope_cos_sin(MAX_POS, rotary_dim, device=device)
    _check_against_reference(q, k, positions, cos_sin, layout, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_input_with_per_batch_or_shared_positions(device, layout):
    q, k, positions = _qk((2, 7), 4, 2, 16, torch.float32, device)
    cos_sin = rope_cos_sin(MAX_POS, 16, device=device)
    _check_against_reference(q, k, positions, cos_sin, layout, torch.float32)
    _check_against_reference(q, k, positions[0], cos_sin, layout, torch.float32)


def test_strided_views_are_read_and_written_in_place_layouts(device):
    # q and k sliced from one fused projection, then viewed [B, H, S, D] -> [B, S, H, D] as HF does.
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 5, (4 + 2 + 2) * 8, generator=g).to(device)
    q = qkv[..., : 4 * 8].view(2, 5, 4, 8)
    k = qkv[..., 4 * 8 : 6 * 8].view(2, 5, 2, 8)
    positions = torch.tensor([3, 9, 1, 0, 40], device=device)
    cos_sin = rope_cos_sin(MAX_POS, 8, device=device)
    _check_against_reference(q, k, positions, cos_sin, "rotate_half", torch.float32)
    q_bhsd = q.transpose(1, 2).contiguous()
    out_q, _ = apply_rope(q_bhsd.transpose(1, 2), k, positions, cos_sin)
    assert out_q.stride() == q_bhsd.transpose(1, 2).stride()  # a transposed view stays one
    assert_close(out_q, reference.apply_rope(q.double(), k.double(), positions, cos_sin.double())[0], torch.float32)


def test_many_heads_take_several_head_blocks(device, monkeypatch):
    monkeypatch.setattr(rope_module, "_TILE_ELEMENTS", 16)
    q, k, positions = _qk((3,), 7, 5, 32, torch.float32, device)
    _check_against_reference(q, k, positions, rope_cos_sin(MAX_POS, 32, device=device), "rotate_half", torch.float32)


def test_many_tokens_take_the_narrow_head_tile(device, monkeypatch):
    # Past _MANY_TOKENS tokens q and k are walked in narrower head blocks: 7 q heads of 16 pairs in blocks of 2.
    monkeypatch.setattr(rope_module, "_MANY_TOKENS", 4)
    monkeypatch.setattr(rope_module, "_MANY_TOKENS_TILE_ELEMENTS", 32)
    q, k, positions = _qk((6,), 7, 5, 32, torch.bfloat16, device)
    assert rope_module._rope_meta(32, 32, 7, 5, False, False, None, None, True)["BLOCK_Q_HEADS"] == 2
    _check_against_reference(q, k, positions, rope_cos_sin(MAX_POS, 32, device=device), "rotate_half", torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backward_matches_autograd_of_reference(device, dtype, layout):
    q, k, positions = _qk((4,), 3, 2, 40, dtype, device)
    cos_sin = rope_cos_sin(MAX_POS, 24, device=device)
    g = torch.Generator().manual_seed(1)
    dq = torch.randn(q.shape, generator=g).to(dtype).to(device)
    dk = torch.randn(k.shape, generator=g).to(dtype).to(device)
    qk, kk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    out_q, out_k = apply_rope(qk, kk, positions, cos_sin, layout)
    torch.autograd.backward((out_q, out_k), (dq, dk))
    qr, kr = leaf(q), leaf(k)
    ref_q, ref_k = reference.apply_rope(qr, kr, positions, cos_sin.double(), layout)
    torch.autograd.backward((ref_q, ref_k), (dq.double(), dk.double()))
    assert_close(qk.grad, qr.grad, dtype)
    assert_close(kk.grad, kr.grad, dtype)


def test_gradient_through_q_only(device):
    q, k, positions = _qk((3,), 2, 1, 8, torch.float32, device)
    cos_sin = rope_cos_sin(MAX_POS, 8, device=device)
    qk = q.clone().requires_grad_(True)
    out_q, _ = apply_rope(qk, k, positions, cos_sin)
    out_q.sum().backward()
    qr = leaf(q)
    reference.apply_rope(qr, k.double(), positions, cos_sin.double())[0].sum().backward()
    assert_close(qk.grad, qr.grad, torch.float32)


def test_cache_holds_cos_then_sin_of_position_times_frequency():
    cos_sin = rope_cos_sin(10, 6, base=100.0)
    freqs = [100.0 ** (-2 * i / 6) for i in range(3)]
    expected = torch.tensor([[math.cos(p * f) for f in freqs] + [math.sin(p * f) for f in freqs] for p in range(10)])
    torch.testing.assert_close(cos_sin, expected.float())


def test_llama3_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    config = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=512, rope_parameters=dict(scaling, rope_theta=500000.0)
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    positions = torch.arange(512, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq.double())
    expected = torch.cat([angles.cos(), angles.sin()], dim=-1)
    got = rope_cos_sin(512, 64, base=500000.0, scaling=scaling, dtype=torch.float64)
    # transformers computes the frequencies in float32: at position 511 that is ~5e-5 of angle.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert not torch.allclose(got, rope_cos_sin(512, 64, base=500000.0, dtype=torch.float64))


def test_positions_outside_the_cache_give_nan(device):
    q, k, _ = _qk((3,), 2, 1, 8, torch.float32, device)
    positions = torch.tensor([0, MAX_POS, -1], device=device)
    out_q, out_k = apply_rope(q, k, positions, rope_cos_sin(MAX_POS, 8, device=device))
    assert torch.isfinite(out_q[0]).all() and torch.isnan(out_q[1:]).all() and torch.isnan(out_k[1:]).all()


def test_nan_propagates_like_reference(device):
    q, k, positions = _qk((2,), 2, 1, 8, torch.float32, device)
    q[0, 1, 2] = float("nan")
    k[1, 0, 5] = float("inf")
    cos_sin = rope_cos_sin(MAX_POS, 8, device=device)
    got = apply_rope(q, k, positions, cos_sin)
    expected = reference.apply_rope(q.double(), k.double(), positions, cos_sin.double())
    for g, e in zip(got, expected):
        assert torch.equal(torch.isnan(g), torch.isnan(e))


def test_no_tokens(device):
    q, k, positions = _qk((0,), 2, 1, 8, torch.float32, device)
    out_q, out_k = apply_rope(q, k, positions, rope_cos_sin(MAX_POS, 8, device=device))
    assert out_q.shape == q.shape and out_k.shape == k.shape


def test_bad_inputs_name_the_argument(device):
    q, k, positions = _qk((3,), 2, 1, 8, torch.float32, device)
    cos_sin = rope_cos_sin(MAX_POS, 8, device=device)
    cases = [
        (dict(q=q.double()), TypeError, "q"),
        (dict(k=k[..., :4]), ValueError, "k"),
        (dict(q=q[0]), ValueError, "q"),
        (dict(positions=positions.float()), TypeError, "positions"),
        (dict(positions=positions[:2]), ValueError, "positions"),
        (dict(cos_sin=rope_cos_sin(MAX_POS, 16, device=device)), ValueError, "cos_sin"),
        (dict(cos_sin=cos_sin[:, :7]), ValueError, "cos_sin"),
        (dict(layout="neox"), ValueError, "layout"),
        (dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "head_dim"),  # last stride 2
    ]
    for override, error, name in cases:
        kw = dict(q=q, k=k, positions=positions, cos_sin=cos_sin) | override
        with pytest.raises(error, match=name):
            apply_rope(**kw)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_cos_sin(8, 5)
    with pytest.raises(ValueError, match="scaling"):
        rope_cos_sin(8, 4, scaling={"rope_type": "yarn", "factor": 2.0})


@settings(max_examples=10, deadline=None)
@given(
    tokens=st.integers(1, 6),
    q_heads=st.integers(1, 5),
    k_heads=st.integers(1, 3),
    half=st.integers(1, 12),
    extra=st.integers(0, 5),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_reference(tokens, q_heads, k_heads, half, extra, layout, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, k, positions = _qk((tokens,), q_heads, k_heads, 2 * half + extra, torch.float32, device, seed=seed)
    _check_against_reference(q, k, positions, rope_cos_sin(MAX_POS, 2 * half, device=device), layout, torch.float32)


# --------------------------------------------------------------------------------------------
# The decode layout's kernel (_rope_decode_kernel) against the general one
# --------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit pattern, so that NaN rows compare equal too."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_as_general_kernel(q, k, positions, cos_sin, layout):
    assert rope_module._decode_layout_ok(q, k, positions, cos_sin, layout)
    got = apply_rope(q, k, positions, cos_sin, layout)
    general = rope_module._launch_rope(q, k, positions, cos_sin, layout == "interleaved", inverse=False)
    for out, expected in zip(got, general, strict=True):
        assert out.shape == expected.shape and out.stride() == expected.stride()
        assert torch.equal(_bits(out), _bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens, q_heads, k_heads, head_dim, rotary_dim",
                         [(1, 1, 1, 2, 2), (3, 5, 3, 24, 6), (17, 7, 1, 80, 32), (4, 6, 2, 16, 16)])
def test_decode_layout_views_of_a_projection_as_the_general_kernel(device, dtype, layout, tokens, q_heads, k_heads,
                                                                   head_dim, rotary_dim):
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, generator=g).to(dtype).to(device)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + k_heads) * head_dim].view(tokens, k_heads, head_dim)
    # Some positions outside the cache: NaN rows on both paths.
    positions = torch.randint(-2, MAX_POS + 2, (tokens,), generator=g).to(torch.int32 if tokens % 2 else torch.int64)
    _assert_as_general_kernel(q, k, positions.to(device), rope_cos_sin(MAX_POS, rotary_dim, device=device), layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_layout_batched_inputs_as_the_general_kernel(device, layout):
    q, k, positions = _qk((3, 5), 4, 2, 24, torch.bfloat16, device)
    cos_sin = rope_cos_sin(MAX_POS, 16, device=device)
    _assert_as_general_kernel(q, k, positions, cos_sin, layout)
    _assert_as_general_kernel(q[:1], k[:1], positions[0], cos_sin, layout)  # one batch, [seq] positions
    # Views of one projection [batch, seq, (q + 2 kv heads) · head_dim], as Hugging Face's q/k before the transpose.
    qkv = torch.randn(2, 3, 8 * 24, device=device)
    _assert_as_general_kernel(qkv[..., : 4 * 24].view(2, 3, 4, 24), qkv[..., 4 * 24 : 6 * 24].view(2, 3, 2, 24),
                              positions[:2, :3].contiguous(), cos_sin, layout)


def test_other_layouts_take_the_general_kernel(device, monkeypatch):
    def refuse(*args):
        raise AssertionError("the decode layout's kernel took inputs of another layout")

    monkeypatch.setattr(rope_module, "_launch_rope_decode", refuse)
    q, k, positions = _qk((2, 5), 4, 2, 16, torch.float32, device)
    cos_sin = rope_cos_sin(MAX_POS, 16, device=device)
    wide_cos_sin = rope_cos_sin(MAX_POS, 32, device=device)[:, :16]  # rows 32 apart
    cases = [
        (q.transpose(1, 2).contiguous().transpose(1, 2), k, positions),  # heads not head_dim apart
        (q, k, positions[0]),  # [seq] positions shared by two batches
        (q[:, ::2], k[:, ::2], positions[:, ::2]),  # batches not seq tokens apart, strided positions
        (q[0], k[0], torch.arange(10, device=device)[::2]),  # strided positions
    ]
    for q_case, k_case, positions_case in cases:
        assert not rope_module._decode_layout_ok(q_case, k_case, positions_case, cos_sin, "rotate_half")
        expected = reference.apply_rope(q_case.double(), k_case.double(), positions_case, cos_sin.double())
        assert_close(apply_rope(q_case, k_case, positions_case, cos_sin)[0], expected[0], torch.float32)
    assert not rope_module._decode_layout_ok(q[0], k[0], positions[0], wide_cos_sin, "rotate_half")
    assert_close(apply_rope(q[0], k[0], positions[0], wide_cos_sin)[1],
                 reference.apply_rope(q[0].double(), k[0].double(), positions[0], wide_cos_sin.double())[1],
                 torch.float32)


def _projection_views(leading, q_heads, k_heads, head_dim, dtype, device, seed=0):
    """q and k views of one projection output [..., (q + 2 kv heads) · head_dim], as a model's."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(*leading, (q_heads + 2 * k_heads) * head_dim, generator=g).to(dtype).to(device)
    q = qkv[..., : q_heads * head_dim].view(*leading, q_heads, head_dim)
    k = qkv[..., q_heads * head_dim : (q_heads + k_heads) * head_dim].view(*leading, k_heads, head_dim)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("leading", [(1,), (5,), (2, 3), (1, 1)])
def test_inplace_is_the_same_bits_written_over_q_and_k(device, dtype, layout, leading):
    q, k = _projection_views(leading, 4, 2, 16, dtype, device)
    positions = torch.randint(0, MAX_POS, leading, generator=torch.Generator().manual_seed(1)).to(device)
    cos_sin = rope_cos_sin(MAX_POS, 12, device=device)  # partial rotary: the pass-through dims too
    expected_q, expected_k = apply_rope(q, k, positions, cos_sin, layout)
    got_q, got_k = apply_rope(q, k, positions, cos_sin, layout, inplace=True)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


def test_inplace_of_other_layouts_copies_back(device, monkeypatch):
    q, k, positions = _qk((2, 5), 4, 2, 16, torch.float32, device)
    q, k = q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(1, 2).contiguous().transpose(1, 2)
    cos_sin = rope_cos_sin(MAX_POS, 16, device=device)
    expected = apply_rope(q, k, positions, cos_sin)
    monkeypatch.setattr(rope_module, "_launch_rope_decode", None)  # not the decode layout's kernel
    got = apply_rope(q, k, positions, cos_sin, inplace=True)
    assert got[0] is q and got[1] is k
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


def test_inplace_refuses_shared_memory_gradients_and_non_bools(device):
    q, k, positions = _qk((3,), 2, 2, 8, torch.float32, device)
    cos_sin = rope_cos_sin(MAX_POS, 8, device=device)
    shifted = torch.randn(3, 5, 8, device=device)  # k's heads start inside q's
    for q_in, k_in in ((q, q), (shifted[:, :2], shifted[:, 1:3]), (q, q[:, :1])):
        q0, k0 = q_in.clone(), k_in.clone()
        with pytest.raises(ValueError, match="inplace=True needs q and k in separate memory"):
            apply_rope(q_in, k_in, positions, cos_sin, inplace=True)
        assert torch.equal(q_in, q0) and torch.equal(k_in, k0)  # nothing written before the refusal
    one = torch.randn(1, 5, 8, device=device)  # one token: its own test of the two runs
    with pytest.raises(ValueError, match="inplace=True needs q and k in separate memory"):
        apply_rope(one[:, :2], one[:, 1:3], positions[:1], cos_sin, inplace=True)
    apply_rope(one[:, :2], one[:, 2:4], positions[:1], cos_sin, inplace=True)
    apply_rope(shifted[:, :2], shifted[:, 2:4], positions, cos_sin, inplace=True)  # apart within each token
    with pytest.raises(RuntimeError, match="records no gradients"):
        apply_rope(q.clone().requires_grad_(True), k, positions, cos_sin, inplace=True)
    with pytest.raises(TypeError, match="inplace must be a bool"):
        apply_rope(q, k, positions, cos_sin, inplace=1)


def test_tokens_apart_for_batched_views(device):
    qkv = torch.randn(2, 3, 8 * 4, device=device)
    q, k = qkv[..., :16].view(2, 3, 2, 8), qkv[..., 16:24].view(2, 3, 1, 8)
    assert rope_module.tokens_apart(q, k)
    assert not rope_module.tokens_apart(q, qkv[..., 8:16].view(2, 3, 1, 8))  # k inside q's heads
    # Batches not seq tokens apart: the runs of one token stride say nothing about them.
    wide = torch.randn(2, 4, 8 * 4, device=device)[:, :3]
    assert not rope_module.tokens_apart(wide[..., :16].view(2, 3, 2, 8), wide[..., 16:24].view(2, 3, 1, 8))
