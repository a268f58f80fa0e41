import pytest
import torch
from kernel_checks import DTYPES, kernel_module
from test_kernels_rope_store import BLOCK_SIZE, MAX_POS, _step

from fuselab.kernels import bind_rope_and_store_kv, rope_and_store_kv, rope_cos_sin

rope_store = kernel_module("rope_store")


@pytest.fixture
def no_fallback(monkeypatch):
    """Any call that goes through rope_and_store_kv itself (not the bound launch) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the bound call went through rope_and_store_kv")

    monkeypatch.setattr(rope_store, "rope_and_store_kv", refuse)


def _expected(q, k, v, positions, cos_sin, k_cache, v_cache, slots, layout):
    """rope_and_store_kv's outputs and caches, on copies."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    q_out, k_out = rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, layout)
    return q_out, k_out, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("tokens, padding", [(1, ()), (5, (2,))])
@pytest.mark.parametrize("inplace", [False, True])
def test_bound_call_is_rope_and_store_kv_bit_for_bit(device, no_fallback, dtype, layout, tokens, padding, inplace):
    q, k, v, positions, slots, k_cache, v_cache = _step(tokens, 4, 2, 16, dtype, device, padding=padding)
    cos_sin = rope_cos_sin(MAX_POS, 12, device=device)  # partial rotary: the pass-through dims too
    expected = _expected(q, k, v, positions, cos_sin, k_cache, v_cache, slots, layout)
    bound = bind_rope_and_store_kv(cos_sin, k_cache, v_cache, layout)
    q_in, k_in = q.clone(), k.clone()  # the second call rotates the same inputs again
    got_q, got_k = bound(q, k, v, positions, slots, inplace=inplace)
    if inplace:
        assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    else:
        assert torch.equal(q, q_in) and torch.equal(k, k_in)
    for got, want in zip((got_q, got_k, k_cache, v_cache), expected, strict=True):
        assert torch.equal(got, want)
    q.copy_(q_in), k.copy_(k_in)
    again = bound(q, k, v, positions, slots, inplace=inplace)
    assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[1])
    assert len(bound._launchers) == 1


def test_bound_call_of_strided_caches_or_inputs_goes_through_rope_and_store_kv(device):
    q, k, v, positions, slots, _, _ = _step(3, 4, 2, 16, torch.float32, device)
    kv = torch.randn(4, 2, BLOCK_SIZE, 2, 16, generator=torch.Generator().manual_seed(3)).to(device)
    k_cache, v_cache = kv[:, 0], kv[:, 1]  # strided caches: the general kernel
    cos_sin = rope_cos_sin(MAX_POS, 16, device=device)
    expected = _expected(q, k, v, positions, cos_sin, k_cache, v_cache, slots, "rotate_half")
    got = bind_rope_and_store_kv(cos_sin, k_cache, v_cache)(q, k, v, positions, slots)
    for a, b in zip((*got, k_cache, v_cache), expected, strict=True):
        assert torch.equal(a, b)
    # Dense caches, a q of another layout (heads further apart than head_dim): the general kernel too.
    q, k, v, positions, slots, k_cache, v_cache = _step(3, 4, 2, 16, torch.float32, device)
    wide = torch.randn(3, 4, 32, device=device)[..., :16]
    expected = _expected(wide, k, v, positions, cos_sin, k_cache, v_cache, slots, "rotate_half")
    bound = bind_rope_and_store_kv(cos_sin, k_cache, v_cache)
    got = bound(wide, k, v, positions, slots)
    assert not bound._launchers
    for a, b in zip((*got, k_cache, v_cache), expected, strict=True):
        assert torch.equal(a, b)


def test_bound_call_of_no_tokens(device):
    q, k, v, positions, slots, k_cache, v_cache = _step(0, 2, 1, 8, torch.float32, device)
    got_q, got_k = bind_rope_and_store_kv(rope_cos_sin(MAX_POS, 8, device=device), k_cache, v_cache)(
        q, k, v, positions, slots)
    assert got_q.shape == (0, 2, 8) and got_k.shape == (0, 1, 8)


def test_bad_bindings_raise_naming_the_argument(device):
    _, _, _, _, _, k_cache, v_cache = _step(3, 4, 2, 16, torch.float32, device)
    cos_sin = rope_cos_sin(MAX_POS, 16, device=device)
    with pytest.raises(ValueError, match="layout must be one of"):
        bind_rope_and_store_kv(cos_sin, k_cache, v_cache, "neox")
    with pytest.raises(ValueError, match="cos_sin must be"):
        bind_rope_and_store_kv(cos_sin[:, :7], k_cache, v_cache)
    with pytest.raises(TypeError, match="cos_sin must be float32"):
        bind_rope_and_store_kv(cos_sin.long(), k_cache, v_cache)
    with pytest.raises(ValueError, match="v_cache has shape"):
        bind_rope_and_store_kv(cos_sin, k_cache, v_cache[:2])
    with pytest.raises(TypeError, match="v_cache must be a torch.Tensor"):
        bind_rope_and_store_kv(cos_sin, k_cache, None)


def test_bad_bound_calls_raise_as_rope_and_store_kv(device):
    q, k, v, positions, slots, k_cache, v_cache = _step(3, 4, 2, 16, torch.float32, device)
    bound = bind_rope_and_store_kv(rope_cos_sin(MAX_POS, 16, device=device), k_cache, v_cache)
    bound(q, k, v, positions, slots)  # a launcher kept for these shapes: the checks below still run
    cases = [
        (dict(q=q.double()), TypeError, "q must be float32"),
        (dict(k=k[..., :8]), ValueError, "k must match q"),
        (dict(positions=positions.float()), TypeError, "positions"),
        (dict(positions=positions[:2]), ValueError, "positions"),
        (dict(v=v[:2]), ValueError, "v has 2 tokens but k has 3"),
        (dict(v=v.half()), TypeError, "v_cache has dtype torch.float32 but v has dtype torch.float16"),
        (dict(slot_mapping=slots.long()), TypeError, "slot_mapping must be int32"),
        (dict(slot_mapping=slots[:2]), ValueError, "slot_mapping has 2 entries for 3 tokens"),
        (dict(slot_mapping=slots.tolist()), TypeError, "slot_mapping must be a torch.Tensor"),
        (dict(inplace="yes"), TypeError, "inplace must be a bool"),
    ]
    for override, error, message in cases:
        kw = dict(q=q, k=k, v=v, positions=positions, slot_mapping=slots) | override
        with pytest.raises(error, match=message):
            bound(**kw)
    qkv = torch.randn(3, 2, 16, device=device)  # q and k one tensor
    with pytest.raises(ValueError, match="inplace=True needs q, k and v in separate memory"):
        bind_rope_and_store_kv(rope_cos_sin(MAX_POS, 16, device=device), k_cache[:, :, :2].contiguous(),
                               v_cache[:, :, :2].contiguous())(qkv, qkv, qkv.clone(), positions, slots, inplace=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        bound(q.clone().requires_grad_(True), k, v, positions, slots)
