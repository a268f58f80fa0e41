"""Bad index inputs never take a kernel outside its tensors, and the validating mode names them.

Each index-taking op is called with indices past its tensors, which sit inside NaN guard regions
(guard_regions.py): a read out of bounds would bring NaN into the result, a write would overwrite
the guard. The property-based versions are in test_kernels_bounds_fuzz.py.
"""

import importlib

import pytest
import torch
from guard_regions import assert_guards_hold, guarded
from kernel_checks import assert_close

from fuselab.kernels import (
    apply_rope,
    cross_entropy,
    decode_attention,
    flash_attention,
    flash_attention_varlen,
    reference,
    rope_and_store_kv,
    rope_cos_sin,
    store_kv,
)
from fuselab.kernels._common import indices

NAN = float("nan")
BLOCK = 16  # tokens a cache block holds
HEAD_DIM = 16


def _randn(shape, device, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _packed(tokens, device, guard_rows=16):
    """q [tokens, 2, 16], k, v [tokens, 1, 16], each with `guard_rows` rows of NaN either side."""
    views = []
    for seed, heads in enumerate((2, 1, 1)):
        view, _ = guarded(_randn((tokens, heads, HEAD_DIM), device, seed), guard_rows * heads * HEAD_DIM, NAN)
        views.append(view)
    return views


def _cache(num_blocks, device, guard_blocks, seed=0):
    """A [num_blocks, BLOCK, 1, HEAD_DIM] cache with `guard_blocks` blocks of NaN either side: (cache, buffer, guard)."""
    guard = guard_blocks * BLOCK * HEAD_DIM
    cache, buffer = guarded(_randn((num_blocks, BLOCK, 1, HEAD_DIM), device, seed), guard, NAN)
    return cache, buffer, guard


# --------------------------------------------------------------------------------------------
# flash_attention_varlen: cu_seqlens past the tokens
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("end", [9, 20])
def test_varlen_offsets_past_the_tokens_are_clamped_to_them(device, end):
    q, k, v = _packed(8, device)
    cu = _int32([0, end], device)
    out = flash_attention_varlen(q, k, v, cu, end, check_indices=False)
    expected = reference.attention_varlen(q.double(), k.double(), v.double(), _int32([0, 8], device))
    assert_close(out, expected, torch.float32)
    with pytest.raises(ValueError, match=rf"cu_seqlens\[1\] = {end} is past the 8 tokens of q"):
        flash_attention_varlen(q, k, v, cu, end, check_indices=True)


def test_varlen_backward_with_offsets_past_the_tokens_stays_inside_the_tensors(device):
    q, k, v = (t.requires_grad_(True) for t in _packed(8, device))
    dout, _ = guarded(_randn((8, 2, HEAD_DIM), device, 5), 16 * 2 * HEAD_DIM, NAN)
    flash_attention_varlen(q, k, v, _int32([0, 3, 20], device), 20, check_indices=False).backward(dout)
    for t in (q, k, v):
        assert t.grad.isfinite().all()


def test_varlen_validating_mode_names_unsorted_offsets_and_a_short_max_seqlen(device):
    q, k, v = _packed(8, device)
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] must be 0"):
        flash_attention_varlen(q, k, v, _int32([1, 8], device), 8, check_indices=True)
    with pytest.raises(ValueError, match=r"non-decreasing: cu_seqlens\[2\] = 3 is below cu_seqlens\[1\] = 5"):
        flash_attention_varlen(q, k, v, _int32([0, 5, 3, 8], device), 8, check_indices=True)
    with pytest.raises(ValueError, match="max_seqlen = 4 is shorter than sequence 1, of 6 tokens"):
        flash_attention_varlen(q, k, v, _int32([0, 2, 8], device), 4, check_indices=True)


# --------------------------------------------------------------------------------------------
# decode_attention: lengths past the table, block ids outside the cache
# --------------------------------------------------------------------------------------------


def test_decode_length_past_its_block_table_reads_only_the_table(device):
    cache, _, _ = _cache(4, device, guard_blocks=4)
    values, _, _ = _cache(4, device, guard_blocks=4, seed=1)
    # Entries past the one-block table's end hold block 4: the first guard block, NaN.
    table, _ = guarded(_int32([[2]], device), 8, 4)
    q = _randn((1, 2, HEAD_DIM), device, 7)
    out = decode_attention(q, cache, values, table, _int32([40], device), check_indices=False)
    expected = reference.decode_attention(q.double(), cache.double(), values.double(), table, _int32([16], device))
    assert_close(out, expected, torch.float32)
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 40 is more tokens than a row of block_tables holds"):
        decode_attention(q, cache, values, table, _int32([40], device), check_indices=True)


def test_decode_block_id_outside_the_cache_reads_as_zeros(device):
    # Block 99 of a 4-block cache: inside the guard region after it, which holds NaN.
    cache, _, _ = _cache(4, device, guard_blocks=100)
    values, _, _ = _cache(4, device, guard_blocks=100, seed=1)
    q = _randn((1, 2, HEAD_DIM), device, 7)
    table, lengths = _int32([[1, 99]], device), _int32([20], device)
    out = decode_attention(q, cache, values, table, lengths, check_indices=False)
    zero = torch.zeros_like(cache[:1])
    expected = reference.decode_attention(q.double(), torch.cat([cache, zero]).double(),
                                          torch.cat([values, zero]).double(), _int32([[1, 4]], device), lengths)
    assert_close(out, expected, torch.float32)
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 99 is not a block of the cache \(k_cache has 4\)"):
        decode_attention(q, cache, values, table, lengths, check_indices=True)


def test_decode_validating_mode_ignores_table_entries_past_each_length(device):
    cache, _, _ = _cache(4, device, guard_blocks=1)
    q = _randn((2, 2, HEAD_DIM), device, 7)
    table = _int32([[0, -1], [3, 1]], device)  # sequence 0 never reads its -1
    out = decode_attention(q, cache, cache, table, _int32([16, 17], device), check_indices=True)
    assert out.isfinite().all()
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = -1 is negative"):
        decode_attention(q, cache, cache, table, _int32([16, -1], device), check_indices=True)


# --------------------------------------------------------------------------------------------
# store_kv and rope_and_store_kv: slots outside the cache
# --------------------------------------------------------------------------------------------


def test_store_kv_slot_past_the_cache_writes_nothing(device):
    caches = [_cache(4, device, guard_blocks=64, seed=seed) for seed in (0, 1)]
    (k_cache, k_buffer, guard), (v_cache, v_buffer, _) = caches
    k, v = _randn((2, 1, HEAD_DIM), device, 2), _randn((2, 1, HEAD_DIM), device, 3)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = _int32([0, 1000], device)  # a 64-slot cache
    store_kv(k, v, k_cache, v_cache, slots, check_indices=False)
    assert_guards_hold(k_buffer, guard, NAN)
    assert_guards_hold(v_buffer, guard, NAN)
    reference.store_kv(k, v, k_before, v_before, _int32([0, -1], device))
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 1000 is neither a slot of the cache \(64: 4 blocks of 16\)"):
        store_kv(k, v, k_cache, v_cache, slots, check_indices=True)


def test_store_kv_validating_mode_names_a_repeated_slot_and_takes_padding(device):
    cache, _, _ = _cache(4, device, guard_blocks=1)
    k = _randn((4, 1, HEAD_DIM), device, 2)
    store_kv(k, k, cache, cache.clone(), _int32([-1, 3, -1, 5], device), check_indices=True)
    with pytest.raises(ValueError, match=r"slot_mapping\[3\] = 5 repeats slot_mapping\[1\]"):
        store_kv(k, k, cache, cache.clone(), _int32([-1, 5, 7, 5], device), check_indices=True)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = -2 is neither"):
        store_kv(k, k, cache, cache.clone(), _int32([-2, 5, 7, 6], device), check_indices=True)


def test_rope_and_store_kv_slot_past_the_cache_writes_nothing(device):
    (k_cache, k_buffer, guard), (v_cache, v_buffer, _) = (_cache(4, device, 64, seed) for seed in (0, 1))
    q, k, v = _randn((2, 2, HEAD_DIM), device, 2), _randn((2, 1, HEAD_DIM), device, 3), _randn((2, 1, HEAD_DIM), device, 4)
    positions, cos_sin = _int32([3, 5], device), rope_cos_sin(8, HEAD_DIM, device=device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = _int32([1000, 7], device)
    with torch.no_grad():
        _, got_k = rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, check_indices=False)
    assert_guards_hold(k_buffer, guard, NAN)
    assert_guards_hold(v_buffer, guard, NAN)
    reference.store_kv(got_k, v, k_before, v_before, _int32([-1, 7], device))
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 1000 is neither"):
        rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots, check_indices=True)
    with pytest.raises(ValueError, match=r"positions\[1\] = 8 is outside the 8 rows of cos_sin"):
        rope_and_store_kv(q, k, v, _int32([3, 8], device), cos_sin, k_cache, v_cache, _int32([0, 7], device),
                          check_indices=True)


# --------------------------------------------------------------------------------------------
# apply_rope and cross_entropy: the kernels already mask; the validating mode names the index
# --------------------------------------------------------------------------------------------


def test_apply_rope_validating_mode_names_a_position_outside_the_cache(device):
    q, k = _randn((2, 3, 2, HEAD_DIM), device, 0), _randn((2, 3, 1, HEAD_DIM), device, 1)
    cos_sin = rope_cos_sin(8, HEAD_DIM, device=device)
    positions = _int32([[0, 1, 2], [7, -1, 3]], device)
    got_q, _ = apply_rope(q, k, positions, cos_sin, check_indices=False)
    assert got_q[1, 1].isnan().all() and got_q[1, 0].isfinite().all()
    with pytest.raises(ValueError, match=r"positions\[1, 1\] = -1 is outside the 8 rows of cos_sin"):
        apply_rope(q, k, positions, cos_sin, check_indices=True)


def test_cross_entropy_validating_mode_names_a_target_outside_the_vocabulary(device):
    logits = _randn((3, 10), device, 0)
    target = torch.tensor([2, -100, 10], device=device)
    assert torch.isnan(cross_entropy(logits, target, reduction="none", check_indices=False)[2])
    with pytest.raises(ValueError, match=r"target\[2\] = 10 is neither a class in \[0, 10\) nor ignore_index \(-100\)"):
        cross_entropy(logits, target, check_indices=True)
    assert cross_entropy(logits[:2], target[:2], check_indices=True).isfinite()


# --------------------------------------------------------------------------------------------
# the mode's switch, and flags that must be bools
# --------------------------------------------------------------------------------------------


@pytest.fixture
def checks_from_environment(monkeypatch):
    """indices as imported with FUSELAB_CHECK_INDICES=1; imported again as it was afterwards."""
    monkeypatch.setenv("FUSELAB_CHECK_INDICES", "1")
    importlib.reload(indices)
    yield
    monkeypatch.undo()
    importlib.reload(indices)


def test_environment_variable_turns_the_checks_on_for_every_call(device, checks_from_environment):
    assert indices.CHECK_BY_DEFAULT
    cache, _, _ = _cache(4, device, guard_blocks=1)
    k = _randn((1, 1, HEAD_DIM), device, 2)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, cache, cache.clone(), _int32([64], device))
    store_kv(k, k, cache, cache.clone(), _int32([64], device), check_indices=False)  # skipped: no store


@pytest.mark.parametrize("flag", ["no", 1, None, torch.tensor(True)])
def test_flags_must_be_bools(device, flag):
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in _packed(4, device))
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(q, k, v, causal=flag)
    packed = _packed(4, device)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention_varlen(*packed, _int32([0, 4], device), 4, causal=flag)
    if flag is not None:  # None asks for the environment's default
        with pytest.raises(TypeError, match="check_indices must be a bool"):
            flash_attention_varlen(*packed, _int32([0, 4], device), 4, check_indices=flag)
