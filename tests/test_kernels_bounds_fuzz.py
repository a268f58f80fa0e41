"""Property-based: whatever the index inputs of a kernel hold (out of range, negative, unsorted,
oversized), the call neither crashes nor touches memory outside its tensors, the result is what the
in-kernel masks define, and the validating mode raises exactly when an index is bad.

Every tensor sits in guard regions (guard_regions.py): NaN where a read would show, a sentinel no
result holds where a write would. Index values are drawn near the tensors' ends (landing in the
guard regions) and far past them (FAR_INDICES). Shapes are tiny: the kernels run in Triton's
interpreter in CI.
"""

import pytest
import torch
from guard_regions import FAR_INDICES, assert_guards_hold, guarded
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import assert_close

from fuselab.kernels import (
    apply_rope,
    cross_entropy,
    decode_attention,
    flash_attention_varlen,
    reference,
    rope_and_store_kv,
    rope_cos_sin,
    store_kv,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAN = float("nan")
SENTINEL = 12345.0  # no result of these tests holds it
BLOCK, HEAD_DIM, NUM_BLOCKS = 16, 16, 4
NUM_SLOTS = NUM_BLOCKS * BLOCK
MAX_POS = 8
FUZZ = settings(max_examples=25, deadline=None)


def _index(lo: int, hi: int):
    """Integers in [lo, hi], or far outside every tensor."""
    return st.one_of(st.integers(lo, hi), st.sampled_from(FAR_INDICES))


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _call_checked_and_plain(call, valid: bool, argument: str):
    """The call with check_indices=True where the indices are valid; else that call must raise a
    ValueError naming `argument`, and the result is the unchecked call's."""
    if valid:
        return call(check_indices=True)
    with pytest.raises(ValueError, match=argument):
        call(check_indices=True)
    return call(check_indices=False)


def _cache(seed, guard_blocks, sentinel):
    guard = guard_blocks * BLOCK * HEAD_DIM
    cache, buffer = guarded(_randn((NUM_BLOCKS, BLOCK, 1, HEAD_DIM), seed), guard, sentinel)
    return cache, buffer, guard


# --------------------------------------------------------------------------------------------
# flash_attention_varlen
# --------------------------------------------------------------------------------------------


@FUZZ
@given(tokens=st.integers(1, 12), cu=st.lists(_index(-3, 18), min_size=1, max_size=4),
       max_seqlen=st.integers(0, 30), causal=st.booleans())
def test_varlen_any_cu_seqlens(tokens, cu, max_seqlen, causal):
    guard_rows = 24
    q, k, v = (guarded(_randn((tokens, heads, HEAD_DIM), seed), guard_rows * heads * HEAD_DIM, NAN)[0]
               for seed, heads in enumerate((2, 1, 1)))
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    valid = cu[0] == 0 and min(lengths, default=0) >= 0 and cu[-1] <= tokens and max(lengths, default=0) <= max_seqlen
    out = _call_checked_and_plain(
        lambda **check: flash_attention_varlen(q, k, v, _int32(cu), max_seqlen, causal, **check),
        valid, "cu_seqlens|max_seqlen")
    # The spans the kernels take: offsets clamped to [0, tokens], each end to its start.
    spans = []
    for a, b in zip(cu, cu[1:]):
        first = min(max(a, 0), tokens)
        spans.append((first, min(max(b, first), tokens)))
    for i, (first, end) in enumerate(spans):
        if end - first > min(max_seqlen, tokens):
            continue  # rows past max_seqlen are not computed
        rows = out[first:end]
        assert rows.isfinite().all()
        overlaps = any(f < end and first < e for j, (f, e) in enumerate(spans) if j != i and e > f)
        if not overlaps:
            expected = reference.attention_varlen(q.double(), k.double(), v.double(), _int32([first, end]), causal)
            assert_close(rows, expected[first:end], torch.float32)


# --------------------------------------------------------------------------------------------
# decode_attention
# --------------------------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), batch=st.integers(1, 3), columns=st.integers(1, 3), max_splits=st.sampled_from([1, 3]))
def test_decode_any_block_tables_and_seq_lens(data, batch, columns, max_splits):
    table = data.draw(st.lists(_index(-3, NUM_BLOCKS + 2), min_size=batch * columns, max_size=batch * columns))
    lengths = data.draw(st.lists(_index(-20, columns * BLOCK + 20), min_size=batch, max_size=batch))
    k_cache, _, _ = _cache(0, 3, NAN)
    v_cache, _, _ = _cache(1, 3, NAN)
    q, _ = guarded(_randn((batch, 2, HEAD_DIM), 2), 2 * HEAD_DIM, NAN)
    tables = _int32(table).view(batch, columns)
    capacity = columns * BLOCK
    read = [table[i * columns:i * columns - (-max(0, n) // BLOCK)] for i, n in enumerate(lengths)]
    valid = all(0 <= n <= capacity for n in lengths) and all(0 <= b < NUM_BLOCKS for row in read for b in row)
    # max_seq_len asks for several splits, so that the merge runs too.
    out = _call_checked_and_plain(
        lambda **check: decode_attention(q, k_cache, v_cache, tables, _int32(lengths), max_seq_len=1000,
                                         max_splits=max_splits, **check),
        valid, "seq_lens|block_tables")
    # What the masks define: lengths clamped to [0, capacity], blocks outside the cache read as zeros.
    zero = torch.zeros_like(k_cache[:1])
    in_cache = (tables >= 0) & (tables < NUM_BLOCKS)
    expected = reference.decode_attention(
        q.double(), torch.cat([k_cache, zero]).double(), torch.cat([v_cache, zero]).double(),
        torch.where(in_cache, tables, NUM_BLOCKS), _int32([min(max(n, 0), capacity) for n in lengths]))
    assert_close(out, expected, torch.float32)


# --------------------------------------------------------------------------------------------
# store_kv and rope_and_store_kv
# --------------------------------------------------------------------------------------------


def _kept_slots(slots):
    """The slot mapping as the kernels apply it: any slot outside the cache is no store (-1)."""
    return _int32([s if 0 <= s < NUM_SLOTS else -1 for s in slots])


@FUZZ
@given(slots=st.lists(_index(-4, NUM_SLOTS + 4), min_size=1, max_size=6, unique=True))
def test_store_kv_any_slot_mapping(slots):
    (k_cache, k_buffer, guard), (v_cache, v_buffer, _) = (_cache(seed, 1, NAN) for seed in (0, 1))
    k, v = _randn((len(slots), 1, HEAD_DIM), 2), _randn((len(slots), 1, HEAD_DIM), 3)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    valid = all(-1 <= s < NUM_SLOTS for s in slots)
    _call_checked_and_plain(lambda **check: store_kv(k, v, k_cache, v_cache, _int32(slots), **check),
                            valid, "slot_mapping")
    assert_guards_hold(k_buffer, guard, NAN)
    assert_guards_hold(v_buffer, guard, NAN)
    reference.store_kv(k, v, k_expected, v_expected, _kept_slots(slots))
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def _positions(min_size, max_size):
    return st.lists(st.one_of(st.integers(-3, MAX_POS + 3), st.sampled_from((*FAR_INDICES, 2**40))),
                    min_size=min_size, max_size=max_size)


def _guarded_cos_sin():
    """cos_sin [MAX_POS, HEAD_DIM] between rows of huge values: a rotation by them would show."""
    return guarded(rope_cos_sin(MAX_POS, HEAD_DIM, device=DEVICE), 2 * HEAD_DIM, 1e30)[0]


def _assert_rotated(got, x, positions, cos_sin):
    """Tokens at a position of the cache rotated as the reference does, the others NaN."""
    in_cache = (positions >= 0) & (positions < MAX_POS)
    expected, _ = reference.apply_rope(x.double(), x.double(), torch.where(in_cache, positions, 0), cos_sin.double())
    assert_close(got[in_cache], expected[in_cache], torch.float32)
    assert got[~in_cache].isnan().all()


@FUZZ
@given(data=st.data(), tokens=st.integers(1, 5))
def test_rope_and_store_kv_any_positions_and_slots(data, tokens):
    positions = data.draw(_positions(tokens, tokens))
    slots = data.draw(st.lists(_index(-4, NUM_SLOTS + 4), min_size=tokens, max_size=tokens, unique=True))
    # The cache guards hold a sentinel, not NaN: a token at a bad position stores NaN rows.
    (k_cache, k_buffer, guard), (v_cache, v_buffer, _) = (_cache(seed, 1, SENTINEL) for seed in (0, 1))
    q, k, v = _randn((tokens, 2, HEAD_DIM), 2), _randn((tokens, 1, HEAD_DIM), 3), _randn((tokens, 1, HEAD_DIM), 4)
    cos_sin = _guarded_cos_sin()
    position_tensor = torch.tensor(positions, device=DEVICE)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    valid = all(0 <= p < MAX_POS for p in positions) and all(-1 <= s < NUM_SLOTS for s in slots)
    with torch.no_grad():
        got_q, got_k = _call_checked_and_plain(
            lambda **check: rope_and_store_kv(q, k, v, position_tensor, cos_sin, k_cache, v_cache, _int32(slots),
                                              **check),
            valid, "positions|slot_mapping")
    _assert_rotated(got_q, q, position_tensor, cos_sin)
    _assert_rotated(got_k, k, position_tensor, cos_sin)
    assert_guards_hold(k_buffer, guard, SENTINEL)
    assert_guards_hold(v_buffer, guard, SENTINEL)
    reference.store_kv(got_k, v, k_expected, v_expected, _kept_slots(slots))
    torch.testing.assert_close(k_cache, k_expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, rtol=0, atol=0, equal_nan=True)


@FUZZ
@given(data=st.data(), batch=st.integers(1, 2), seq=st.integers(1, 3), shared=st.booleans())
def test_apply_rope_any_positions(data, batch, seq, shared):
    # 4-D inputs, positions [seq] shared by the batch or [batch, seq].
    shape = (seq,) if shared else (batch, seq)
    positions = torch.tensor(data.draw(_positions(seq * (1 if shared else batch), seq * (1 if shared else batch))),
                             device=DEVICE).view(shape)
    q, k = _randn((batch, seq, 2, HEAD_DIM), 0), _randn((batch, seq, 1, HEAD_DIM), 1)
    cos_sin = _guarded_cos_sin()
    valid = bool(((positions >= 0) & (positions < MAX_POS)).all())
    got_q, got_k = _call_checked_and_plain(lambda **check: apply_rope(q, k, positions, cos_sin, **check),
                                           valid, "positions")
    full = positions.expand(batch, seq)
    _assert_rotated(got_q, q, full, cos_sin)
    _assert_rotated(got_k, k, full, cos_sin)


# --------------------------------------------------------------------------------------------
# cross_entropy
# --------------------------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), rows=st.integers(1, 4), vocab=st.integers(1, 40), with_grad=st.booleans())
def test_cross_entropy_any_targets(data, rows, vocab, with_grad):
    targets = data.draw(st.lists(st.one_of(_index(-3, vocab + 3), st.just(-100)), min_size=rows, max_size=rows))
    # Huge logits around the row: read as a logit, one would take over the log-sum-exp.
    logits, buffer = guarded(_randn((rows, vocab), 0), 8, 1e4)
    logits.requires_grad_(with_grad)
    target = torch.tensor(targets, device=DEVICE)
    valid = all(t == -100 or 0 <= t < vocab for t in targets)
    loss = _call_checked_and_plain(lambda **check: cross_entropy(logits, target, reduction="none", **check),
                                   valid, "target")
    assert_guards_hold(buffer.detach(), 8, 1e4)
    in_vocab = (target >= 0) & (target < vocab)
    kept = in_vocab | (target == -100)
    expected = reference.cross_entropy(logits.detach().double()[kept], target[kept], reduction="none")
    assert_close(loss[kept], expected, torch.float32)
    assert loss[~kept].isnan().all()
    if with_grad:
        loss.backward(torch.ones_like(loss))
        assert logits.grad.isfinite().all()
