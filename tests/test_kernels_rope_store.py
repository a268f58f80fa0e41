import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import DTYPES, assert_close

from fuselab.kernels import apply_rope, reference, rope_and_store_kv, rope_cos_sin, store_kv
from fuselab.kernels import rope as rope_module

LAYOUTS = ("rotate_half", "interleaved")
MAX_POS = 64
BLOCK_SIZE = 16


def _step(tokens, heads, kv_heads, head_dim, dtype, device, num_blocks=4, padding=(), seed=0):
    """One attention step as the engine builds it: q, k, v views of one merged projection output,
    random (unsorted) positions, distinct random slots (padding rows get -1) and caches of noise."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=g).to(device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:tokens].to(torch.int32)
    slots[list(padding)] = -1
    cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(dtype).to(device)
    v_cache = torch.randn(cache_shape, generator=g).to(dtype).to(device)
    return q, k, v, positions, slots.to(device), k_cache, v_cache


def _check(q, k, v, positions, cos_sin, k_cache, v_cache, slots, layout, dtype):
    k_before, v_before = k_cache.clone(), v_cache.clone()
    got_q, got_k = rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, layout)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    assert got_q.dtype == q.dtype and got_k.dtype == k.dtype
    # Against the float64 reference: the outputs, and every cache row, written or not.
    ref_k_cache, ref_v_cache = k_before.double(), v_before.double()
    ref_q, ref_k = reference.rope_and_store_kv(
        q.double(), k.double(), v.double(), positions, cos_sin.double(), ref_k_cache, ref_v_cache, slots, layout
    )
    assert_close(got_q, ref_q, dtype)
    assert_close(got_k, ref_k, dtype)
    assert_close(k_cache, ref_k_cache, dtype)
    assert_close(v_cache, ref_v_cache, dtype)
    # Exactly: the cache holds the returned k and the given v, and padding rows kept their old values.
    reference.store_kv(got_k, v, k_before, v_before, slots)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    return got_q, got_k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens, padding", [(1, ()), (3, (1,)), (17, (0, 9, 16))])
def test_matches_reference_gqa_views_of_a_merged_projection(device, dtype, layout, tokens, padding):
    q, k, v, positions, slots, k_cache, v_cache = _step(tokens, 4, 2, 16, dtype, device, num_blocks=2, padding=padding)
    if tokens > 1:  # a token's row of the merged output
        assert q.stride(0) == k.stride(0) == v.stride(0) == (4 + 2 * 2) * 16
    _check(q, k, v, positions, rope_cos_sin(MAX_POS, 16, device=device), k_cache, v_cache, slots, layout, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_rotary_passes_the_other_dims_through_to_the_cache(device, layout):
    q, k, v, positions, slots, k_cache, v_cache = _step(5, 3, 1, 24, torch.float32, device, padding=(2,))
    _check(q, k, v, positions, rope_cos_sin(MAX_POS, 6, device=device), k_cache, v_cache, slots, layout, torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_as_apply_rope_then_store_kv(device, layout):
    q, k, v, positions, slots, k_cache, v_cache = _step(7, 8, 2, 32, torch.bfloat16, device, padding=(3,))
    cos_sin = rope_cos_sin(MAX_POS, 32, device=device)
    k_cache2, v_cache2 = k_cache.clone(), v_cache.clone()
    got = rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, layout)
    expected = apply_rope(q, k, positions, cos_sin, layout)
    store_kv(expected[1], v, k_cache2, v_cache2, slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(k_cache, k_cache2) and torch.equal(v_cache, v_cache2)


def test_padding_rows_leave_the_cache_untouched(device):
    q, k, v, positions, _, k_cache, v_cache = _step(3, 2, 2, 8, torch.float32, device)
    cos_sin = rope_cos_sin(MAX_POS, 8, device=device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.full((3,), -1, dtype=torch.int32, device=device)
    got_q, got_k = rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    # The outputs are still apply_rope's, padding or not.
    ref_q, ref_k = reference.apply_rope(q.double(), k.double(), positions, cos_sin.double())
    assert_close(got_q, ref_q, torch.float32)
    assert_close(got_k, ref_k, torch.float32)


def test_inputs_are_not_written(device):
    q, k, v, positions, slots, k_cache, v_cache = _step(4, 2, 1, 8, torch.float32, device)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    rope_and_store_kv(q, k, v, positions, rope_cos_sin(MAX_POS, 8, device=device), k_cache, v_cache, slots)
    assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)


def test_caches_with_any_strides(device):
    # One [num_blocks, 2, block_size, kv_heads, head_dim] buffer for both caches, padded past head_dim.
    q, k, v, positions, slots, _, _ = _step(6, 4, 2, 16, torch.float32, device, padding=(4,))
    kv = torch.randn(4, 2, BLOCK_SIZE, 2, 20, generator=torch.Generator().manual_seed(5)).to(device)
    k_cache, v_cache = kv[:, 0, ..., :16], kv[:, 1, ..., :16]
    kv_before = kv.clone()
    _check(q, k, v, positions, rope_cos_sin(MAX_POS, 16, device=device), k_cache, v_cache, slots, "rotate_half",
           torch.float32)
    assert torch.equal(kv[..., 16:], kv_before[..., 16:])  # nothing past head_dim is touched


def test_many_heads_take_several_head_blocks(device, monkeypatch):
    monkeypatch.setattr(rope_module, "_TILE_ELEMENTS", 16)
    q, k, v, positions, slots, k_cache, v_cache = _step(3, 7, 5, 16, torch.float32, device, padding=(1,))
    _check(q, k, v, positions, rope_cos_sin(MAX_POS, 16, device=device), k_cache, v_cache, slots, "interleaved",
           torch.float32)


def test_no_tokens(device):
    q, k, v, positions, slots, k_cache, v_cache = _step(0, 2, 1, 8, torch.float32, device)
    k_before = k_cache.clone()
    cos_sin = rope_cos_sin(MAX_POS, 8, device=device)
    out_q, out_k = rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    assert out_q.shape == q.shape and out_k.shape == k.shape and torch.equal(k_cache, k_before)


def test_refuses_inputs_that_require_grad(device):
    q, k, v, positions, slots, k_cache, v_cache = _step(2, 2, 1, 8, torch.float32, device)
    cos_sin = rope_cos_sin(MAX_POS, 8, device=device)
    with pytest.raises(RuntimeError, match="not differentiable"):
        rope_and_store_kv(q.requires_grad_(True), k, v, positions, cos_sin, k_cache, v_cache, slots)
    with torch.no_grad():
        rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)


def test_bad_inputs_name_the_argument(device):
    q, k, v, positions, slots, k_cache, v_cache = _step(3, 4, 2, 16, torch.float32, device)
    cos_sin = rope_cos_sin(MAX_POS, 16, device=device)
    cases = [
        # apply_rope's checks
        (dict(q=q.double()), TypeError, "q must be float32"),
        (dict(k=k[..., :8]), ValueError, "k must match q"),
        (dict(positions=positions.float()), TypeError, "positions"),
        (dict(positions=positions[:2]), ValueError, "positions"),
        (dict(cos_sin=cos_sin[:, :7]), ValueError, "cos_sin"),
        (dict(layout="neox"), ValueError, "layout"),
        # the cache store's
        (dict(q=q[None], k=k[None]), ValueError, r"q must be \[tokens, heads, head_dim\] to store"),
        (dict(q=q[:, :3], k=k[:, :1]), ValueError, r"k must be \[tokens, 2, 16\]"),
        (dict(v=v[:, :1]), ValueError, r"v must be \[tokens, 2, 16\]"),
        (dict(v=v[:2]), ValueError, "v has 2 tokens but k has 3"),
        (dict(v=v.double()), TypeError, "v must be float32"),
        (dict(v=v.half()), TypeError, "v_cache has dtype torch.float32 but v has dtype torch.float16"),
        (dict(v=v.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "v must have a contiguous last"),
        (dict(k_cache=k_cache.half()), TypeError, "v_cache has dtype"),
        (dict(k_cache=k_cache.half(), v_cache=v_cache.half()), TypeError, "k_cache has dtype torch.float16 but k"),
        (dict(v_cache=v_cache[:2]), ValueError, "v_cache has shape"),
        (dict(k_cache=k_cache[0]), ValueError, "k_cache must be"),
        (dict(k_cache=k_cache[:, :12], v_cache=v_cache[:, :12]), ValueError, "block_size"),
        (dict(v_cache=[0.0]), TypeError, "v_cache must be a torch.Tensor"),
        (dict(slot_mapping=slots.long()), TypeError, "slot_mapping must be int32"),
        (dict(slot_mapping=slots[:2]), ValueError, "slot_mapping has 2 entries for 3 tokens"),
        (dict(slot_mapping=slots[None]), ValueError, "slot_mapping must be 1-D"),
        (dict(slot_mapping=slots.tolist()), TypeError, "slot_mapping must be a torch.Tensor"),
    ]
    if device.type == "cpu":
        cases.append((dict(slot_mapping=slots.to("meta")), ValueError, "slot_mapping is on meta"))
    for override, error, message in cases:
        kw = dict(q=q, k=k, v=v, positions=positions, cos_sin=cos_sin, k_cache=k_cache, v_cache=v_cache,
                  slot_mapping=slots) | override
        with pytest.raises(error, match=message):
            rope_and_store_kv(**kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens, padding, strided_caches", [(1, (), False), (5, (2,), False), (3, (), True)])
def test_inplace_is_the_same_bits_written_over_q_and_k(device, dtype, layout, tokens, padding, strided_caches):
    q, k, v, positions, slots, k_cache, v_cache = _step(tokens, 4, 2, 16, dtype, device, padding=padding)
    if strided_caches:  # not the decode layout: the general kernel, then copied back
        kv = torch.randn(4, 2, BLOCK_SIZE, 2, 16, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    cos_sin = rope_cos_sin(MAX_POS, 12, device=device)  # partial rotary: the pass-through dims too
    k_cache2, v_cache2 = k_cache.clone(), v_cache.clone()
    expected_q, expected_k = rope_and_store_kv(q, k, v, positions, cos_sin, k_cache2, v_cache2, slots, layout)
    v_before = v.clone()
    got_q, got_k = rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, layout, inplace=True)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert got_q.stride() == q.stride() and got_k.stride() == k.stride()
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(v, v_before)
    assert torch.equal(k_cache, k_cache2) and torch.equal(v_cache, v_cache2)


@pytest.mark.parametrize("tokens", [1, 3])
def test_inplace_refuses_inputs_that_share_memory(device, tokens):
    q, k, v, positions, slots, k_cache, v_cache = _step(tokens, 2, 2, 8, torch.float32, device)
    cos_sin = rope_cos_sin(MAX_POS, 8, device=device)
    qkv = torch.randn(tokens, 2, 8, device=device)  # q and k one tensor
    shifted = torch.randn(tokens, 5, 8, device=device)  # k's heads start inside q's
    separate = torch.randn(tokens, 2, 8, device=device), torch.randn(tokens, 2, 8, device=device)
    for q_in, k_in, v_in in ((qkv, qkv, v), (q, k, k), (shifted[:, :2], shifted[:, 1:3], shifted[:, 3:5])):
        q0, k0 = q_in.clone(), k_in.clone()
        with pytest.raises(ValueError, match="inplace=True needs q, k and v in separate memory"):
            rope_and_store_kv(q_in, k_in, v_in, positions, cos_sin, k_cache, v_cache, slots, inplace=True)
        assert torch.equal(q_in, q0) and torch.equal(k_in, k0)  # nothing written before the refusal
    # Separate tensors and views of one projection are taken.
    rope_and_store_kv(*separate, v, positions, cos_sin, k_cache, v_cache, slots, inplace=True)
    rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, inplace=True)
    with pytest.raises(TypeError, match="inplace must be a bool"):
        rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, inplace="yes")


@settings(max_examples=8, deadline=None)
@given(
    tokens=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    half=st.integers(1, 8),
    extra=st.integers(0, 5),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_reference(tokens, kv_heads, group, half, extra, layout, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    padding = (seed % tokens,) if seed % 3 == 0 else ()
    q, k, v, positions, slots, k_cache, v_cache = _step(
        tokens, kv_heads * group, kv_heads, 2 * half + extra, torch.float32, device, padding=padding, seed=seed
    )
    _check(q, k, v, positions, rope_cos_sin(MAX_POS, 2 * half, device=device), k_cache, v_cache, slots, layout,
           torch.float32)


@pytest.mark.gpu
def test_gpu_same_as_apply_rope_then_store_kv_at_real_size():
    q, k, v, positions, slots, k_cache, v_cache = _step(64, 32, 8, 128, torch.bfloat16, "cuda", num_blocks=64,
                                                        padding=(5, 63))
    positions = torch.randint(0, 4096, (64,), device="cuda")
    cos_sin = rope_cos_sin(4096, 128, base=500000.0, device="cuda")
    k_cache2, v_cache2 = k_cache.clone(), v_cache.clone()
    got_q, got_k = rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    ref_q, ref_k = apply_rope(q, k, positions, cos_sin)
    store_kv(ref_k, v, k_cache2, v_cache2, slots)
    assert_close(got_q, ref_q, torch.bfloat16)
    assert_close(got_k, ref_k, torch.bfloat16)
    assert_close(k_cache, k_cache2, torch.bfloat16)
    assert torch.equal(v_cache, v_cache2)
