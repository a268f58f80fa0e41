import pytest
import torch
from kernel_checks import kernel_module
from test_kernels_paged_attention import _paged_cache, _randn, _split_case, many_splits, short_splits  # noqa: F401

from fuselab.kernels import bind_decode_attention, decode_attention

bound_module = kernel_module("attention.bound_decode")


def _both(bound, q, k_cache, v_cache, block_tables, seq_lens, **kwargs):
    return bound(q, block_tables, seq_lens), decode_attention(q, k_cache, v_cache, block_tables, seq_lens, **kwargs)


@pytest.fixture
def no_fallback(monkeypatch):
    """Any call that goes through decode_attention itself (not the bound launch) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the bound call went through decode_attention")

    monkeypatch.setattr(bound_module, "decode_attention", refuse)


@pytest.mark.parametrize("max_splits", [1, 5])
@pytest.mark.parametrize("tickets", [True, False])
def test_bound_call_is_decode_attention_bit_for_bit(device, many_splits, max_splits, tickets):
    q, k_cache, v_cache, block_tables, seq_lens = _split_case(device)
    counters = torch.zeros(q.shape[0] * 2, dtype=torch.int32, device=device) if tickets else None
    bound = bind_decode_attention(k_cache, v_cache, 0.3, max_splits=max_splits, counters=counters)
    for _ in range(2):  # the second call takes the launch kept by the first
        out, expected = _both(bound, q, k_cache, v_cache, block_tables, seq_lens, scale=0.3, max_splits=max_splits,
                              counters=counters)
        assert torch.equal(out, expected)
        assert out.shape == q.shape and out.is_contiguous()
    if tickets:
        assert not counters.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bound_call_takes_its_own_launch_for_dense_inputs(device, many_splits, no_fallback, dtype):
    k_cache, v_cache, block_tables, seq_lens = _paged_cache([40, 3, 129], 2, 32, 16, dtype, device)
    counters = torch.zeros(8, dtype=torch.int32, device=device)
    bound = bind_decode_attention(k_cache, v_cache, max_seq_len=256, max_splits=4, counters=counters)
    q = _randn((3, 8, 32), dtype, device, 7)
    out = bound(q, block_tables, seq_lens)
    out_again = bound(q, block_tables, seq_lens)
    # Another batch and table width: a launch of its own.
    one = bound(q[:1].contiguous(), block_tables[:1, :2].contiguous(), seq_lens[:1].clamp(max=32))
    assert torch.equal(out, out_again)
    expected = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len=256, max_splits=4,
                                counters=counters)
    assert torch.equal(out, expected)
    assert one.shape == (1, 8, 32)
    assert len(bound._launches) == 2


def test_bound_call_of_a_strided_query_goes_through_decode_attention(device, short_splits):
    k_cache, v_cache, block_tables, seq_lens = _paged_cache([40, 17], 2, 16, 16, torch.float32, device)
    qkv = _randn((2, 4 * 16 + 2 * 2 * 16), torch.float32, device, 3)
    q = qkv[:, : 4 * 16].view(2, 4, 16)  # a view of a fused projection: rows further apart than one query
    assert not q.is_contiguous()
    bound = bind_decode_attention(k_cache, v_cache)
    out, expected = _both(bound, q, k_cache, v_cache, block_tables, seq_lens)
    assert torch.equal(out, expected)
    assert not bound._launches


def test_bound_call_of_an_empty_batch(device):
    k_cache, v_cache, block_tables, seq_lens = _paged_cache([5], 2, 16, 16, torch.float32, device)
    bound = bind_decode_attention(k_cache, v_cache)
    out = bound(torch.zeros(0, 4, 16, device=device), block_tables[:0], seq_lens[:0])
    assert out.shape == (0, 4, 16)


def test_bad_bindings_raise_naming_the_argument(device):
    k_cache, v_cache, _, _ = _paged_cache([20, 5], 2, 16, 16, torch.float32, device)
    with pytest.raises(ValueError, match="v_cache has shape"):
        bind_decode_attention(k_cache, v_cache[:, :8].contiguous())
    with pytest.raises(TypeError, match="v_cache must be a torch.Tensor"):
        bind_decode_attention(k_cache, None)
    with pytest.raises(ValueError, match="head dim 24"):
        bind_decode_attention(torch.zeros(4, 16, 2, 24, device=device), torch.zeros(4, 16, 2, 24, device=device))
    with pytest.raises(ValueError, match="max_splits must be a positive int"):
        bind_decode_attention(k_cache, v_cache, max_splits=0)
    with pytest.raises(ValueError, match="max_seq_len must be a non-negative int"):
        bind_decode_attention(k_cache, v_cache, max_seq_len=True)
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        bind_decode_attention(k_cache, v_cache, scale=-1.0)
    with pytest.raises(TypeError, match="counters must be int32"):
        bind_decode_attention(k_cache, v_cache, counters=torch.zeros(4, dtype=torch.int64, device=device))


def test_bad_bound_calls_raise_as_decode_attention(device, many_splits):
    q, k_cache, v_cache, block_tables, seq_lens = _split_case(device, lengths=(300, 5))
    bound = bind_decode_attention(k_cache, v_cache, max_splits=4, counters=torch.zeros(3, dtype=torch.int32,
                                                                                      device=device))
    with pytest.raises(ValueError, match="counters has 3 elements but this call needs at least 4"):
        bound(q, block_tables, seq_lens)
    bound = bind_decode_attention(k_cache, v_cache)
    bound(q, block_tables, seq_lens)  # a launch kept for these shapes: the checks below still run
    with pytest.raises(TypeError, match="k_cache has dtype"):
        bound(q.half(), block_tables, seq_lens)
    with pytest.raises(TypeError, match="seq_lens must be int32"):
        bound(q, block_tables, seq_lens.long())
    with pytest.raises(TypeError, match="block_tables must be int32"):
        bound(q, block_tables.long(), seq_lens)
    with pytest.raises(ValueError, match="one entry per sequence"):
        bound(q, block_tables, seq_lens[:1])
    with pytest.raises(ValueError, match="q must be"):
        bound(q[0], block_tables, seq_lens)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        bound(None, block_tables, seq_lens)
    elsewhere = q.to("meta") if device.type == "cpu" else q.cpu()
    with pytest.raises(ValueError, match=f"q must be a {device.type} tensor"):
        bound(elsewhere, block_tables, seq_lens)
