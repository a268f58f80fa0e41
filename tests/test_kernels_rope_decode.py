import pytest
import torch
from kernel_checks import assert_close, kernel_module
from test_kernels_paged_attention import _paged_cache, _randn, many_splits, short_splits  # noqa: F401

from fuselab.kernels import (
    bind_rope_decode_attention,
    decode_attention,
    reference,
    rope_and_store_kv,
    rope_cos_sin,
    rope_decode_attention,
)

rope_decode = kernel_module("attention.rope_decode")


def _case(device, lengths, heads=8, kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, rotary_dim=None,
          seed=0):
    """Caches holding each sequence's older tokens, and the newest token's qkv row."""
    k_cache, v_cache, block_tables, seq_lens = _paged_cache(lengths, kv_heads, head_dim, block_size, dtype, device,
                                                            seed=seed)
    qkv = _randn((len(lengths), (heads + 2 * kv_heads) * head_dim), dtype, device, seed + 5)
    cos_sin = rope_cos_sin(1024, rotary_dim or head_dim, device=device)
    return qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens


def _slots(block_tables, seq_lens, block_size):
    """Where the block table puts position seq_len - 1; -1 for an empty sequence."""
    slots = []
    for table, n in zip(block_tables.tolist(), seq_lens.tolist()):
        slots.append(table[(n - 1) // block_size] * block_size + (n - 1) % block_size if n > 0 else -1)
    return torch.tensor(slots, dtype=torch.int32, device=block_tables.device)


def _reference(qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens, heads, scale=None, layout="rotate_half"):
    """rope_and_store_kv, then decode_attention, in float64 torch: (output, k_cache, v_cache)."""
    kv_heads, head_dim, block_size = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    k_cache, v_cache = k_cache.double(), v_cache.double()
    q, k, v = qkv.double().view(qkv.shape[0], -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    positions = (seq_lens.long() - 1).clamp(min=0)
    q, _ = reference.rope_and_store_kv(q, k, v, positions, cos_sin.double(), k_cache, v_cache,
                                       _slots(block_tables, seq_lens, block_size), layout)
    return reference.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale), k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_splits", [1, 5])
@pytest.mark.parametrize("tickets", [True, False])
def test_matches_rope_store_then_attention_in_float64(device, many_splits, dtype, max_splits, tickets):
    # Lengths: an empty sequence, the new token alone, one at a page's first slot, and splits short and long.
    lengths = [0, 1, 17, 40, 129]
    qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens = _case(device, lengths, dtype=dtype)
    counters = torch.zeros(16, dtype=torch.int32, device=device) if tickets else None
    expected, k_expected, v_expected = _reference(qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens, 8, 0.3)
    out = rope_decode_attention(qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens, 0.3, max_seq_len=256,
                                max_splits=max_splits, counters=counters)
    assert out.shape == (5, 8, 32) and out.dtype == dtype
    assert_close(out, expected, dtype, scale=4.0)
    assert_close(k_cache, k_expected, dtype)
    assert torch.equal(v_cache.double(), v_expected)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no context: zeros, nothing stored
    if tickets:
        assert not counters.any()


@pytest.mark.parametrize("max_splits", [1, 4])
def test_cache_and_output_are_the_two_ops(device, many_splits, max_splits):
    # The stored key and value are rope_and_store_kv's, element for element; the output decode_attention's.
    lengths = [3, 64, 65, 200]
    qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens = _case(device, lengths, heads=4, kv_heads=4,
                                                                    head_dim=64, dtype=torch.bfloat16, seed=2)
    k_two, v_two = k_cache.clone(), v_cache.clone()
    q, k, v = qkv.view(4, 12, 64).split([4, 4, 4], dim=1)
    q_rot, _ = rope_and_store_kv(q, k, v, seq_lens.long() - 1, cos_sin, k_two, v_two, _slots(block_tables, seq_lens, 16))
    expected = decode_attention(q_rot, k_two, v_two, block_tables, seq_lens, max_seq_len=256, max_splits=max_splits)
    out = rope_decode_attention(qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens, max_seq_len=256,
                                max_splits=max_splits)
    assert torch.equal(k_cache, k_two) and torch.equal(v_cache, v_two)
    assert_close(out, expected.double(), torch.bfloat16)


@pytest.fixture
def no_fallback(monkeypatch):
    """Any call that goes through the two ops (not the one launch) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("the call went through rope_and_store_kv and decode_attention")

    monkeypatch.setattr(rope_decode, "_composed", refuse)


def test_bound_call_takes_one_launch_and_keeps_it(device, many_splits, no_fallback):
    qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens = _case(device, [40, 3, 129], dtype=torch.bfloat16)
    expected, _, _ = _reference(qkv, cos_sin, k_cache.clone(), v_cache.clone(), block_tables, seq_lens, 8)
    bound = bind_rope_decode_attention(cos_sin, k_cache, v_cache, max_seq_len=256, max_splits=4)
    out = bound(qkv, block_tables, seq_lens)
    assert_close(out, expected, torch.bfloat16, scale=4.0)
    # Again with the token stored: the cache holds it now, and the result is the same.
    assert torch.equal(bound(qkv, block_tables, seq_lens), out)
    one = bound(qkv[:1].contiguous(), block_tables[:1].contiguous(), seq_lens[:1])
    assert torch.equal(one, out[:1])
    assert len(bound._launches) == 2


@pytest.mark.parametrize("layout", ["interleaved", "rotate_half"])
def test_other_layouts_take_the_two_ops(device, short_splits, layout):
    # Interleaved pairs, a rotary dim short of the head, a strided qkv: the same results through the two ops.
    rotary_dim = 32 if layout == "interleaved" else 16
    qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens = _case(device, [5, 33], rotary_dim=rotary_dim)
    expected, k_expected, _ = _reference(qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens, 8, layout=layout)
    wide = torch.zeros(2, qkv.shape[1] + 8, device=device)
    wide[:, :qkv.shape[1]] = qkv
    out = rope_decode_attention(wide[:, :qkv.shape[1]], cos_sin, k_cache, v_cache, block_tables, seq_lens,
                                layout=layout)
    assert_close(out, expected, torch.float32)
    assert_close(k_cache, k_expected, torch.float32)


def test_position_outside_the_table_shows_as_nan(device):
    qkv, _, k_cache, v_cache, block_tables, seq_lens = _case(device, [20, 4])
    cos_sin = rope_cos_sin(10, 32, device=device)  # positions 0-9: the first sequence's 19 is outside
    out = rope_decode_attention(qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens)
    assert out[0].isnan().all()
    assert not out[1].isnan().any()


def test_bad_inputs_raise_naming_the_argument(device):
    qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens = _case(device, [20, 5])
    call = lambda **kw: rope_decode_attention(**{**dict(qkv=qkv, cos_sin=cos_sin, k_cache=k_cache,  # noqa: E731
                                                        v_cache=v_cache, block_tables=block_tables,
                                                        seq_lens=seq_lens), **kw})
    with pytest.raises(ValueError, match="qkv's width"):
        call(qkv=qkv[:, :-32].contiguous())
    with pytest.raises(ValueError, match="qkv must be"):
        call(qkv=qkv.view(2, 12, 32))
    with pytest.raises(TypeError, match="qkv has dtype"):
        call(qkv=qkv.half())
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        call(qkv=None)
    with pytest.raises(ValueError, match="cos_sin must be"):
        call(cos_sin=cos_sin[:, :31])
    with pytest.raises(ValueError, match="layout must be one of"):
        call(layout="half")
    with pytest.raises(ValueError, match="max_splits"):
        call(max_splits=0)
    with pytest.raises(TypeError, match="seq_lens"):
        call(seq_lens=seq_lens.long())
    with pytest.raises(ValueError, match="block_tables"):
        call(block_tables=block_tables[:1])
    with pytest.raises(ValueError, match="v_cache has shape"):
        call(v_cache=v_cache[:, :8].contiguous())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run scripts/gpu-check on a GPU machine)")
def test_in_a_cuda_graph_with_new_lengths():
    # Captured once, replayed with the lengths of the next step: the token goes where the new length says.
    device = torch.device("cuda")
    qkv, cos_sin, k_cache, v_cache, block_tables, seq_lens = _case(device, [100, 7], dtype=torch.bfloat16)
    bound = bind_rope_decode_attention(cos_sin, k_cache, v_cache, max_seq_len=512)
    bound(qkv, block_tables, seq_lens)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = bound(qkv, block_tables, seq_lens)
    seq_lens.copy_(torch.tensor([101, 8], dtype=torch.int32))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    expected, k_expected, _ = _reference(qkv, cos_sin, k_before, v_before, block_tables, seq_lens, 8)
    graph.replay()
    assert_close(out, expected, torch.bfloat16, scale=4.0)
    assert_close(k_cache, k_expected, torch.bfloat16)
