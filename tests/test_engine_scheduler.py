"""BlockManager and Scheduler on their own: block accounting, batching, preemption, stop conditions."""

from __future__ import annotations

import pytest

from fuselab.engine.kv_cache import BlockManager
from fuselab.engine.sampling_params import SamplingParams
from fuselab.engine.scheduler import Scheduler
from fuselab.engine.sequence import Sequence, SequenceStatus


def _seq(seq_id, n_tokens, **params):
    return Sequence(seq_id, list(range(1, n_tokens + 1)), SamplingParams(**params), seed=seq_id)


def _scheduler(num_blocks=8, block_size=4, max_num_seqs=8, max_tokens=64, max_model_len=32, eos=(0,)):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, max_tokens, max_model_len, eos)


def test_block_manager_allocates_appends_and_frees():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq(0, 5)
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    for _ in range(3):  # tokens 6..8 still fit the second block
        seq.append_token(9)
        assert bm.can_append(seq)
        bm.append(seq)
    assert len(seq.block_table) == 2
    seq.append_token(9)  # token 9 opens a third block
    bm.append(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 1
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 4
    assert not bm.can_allocate(_seq(1, 17))


def test_block_manager_refuses_what_it_lacks():
    bm = BlockManager(num_blocks=1, block_size=4)
    with pytest.raises(RuntimeError, match="needs 2 blocks"):
        bm.allocate(_seq(0, 5))


def test_prefill_batches_waiting_prompts_within_the_token_budget():
    s = _scheduler(num_blocks=64, max_tokens=20)
    for i, n in enumerate((8, 8, 8)):
        s.add(_seq(i, n))
    batch, is_prefill = s.schedule()
    assert is_prefill and [q.seq_id for q in batch] == [0, 1]  # 24 tokens would pass the budget of 20
    batch, is_prefill = s.schedule()
    assert is_prefill and [q.seq_id for q in batch] == [2]


def test_prefill_respects_max_num_seqs_then_decodes_everyone():
    s = _scheduler(num_blocks=64, max_num_seqs=2)
    for i in range(3):
        s.add(_seq(i, 3))
    batch, is_prefill = s.schedule()
    assert is_prefill and len(batch) == 2
    s.postprocess(batch, [7, 7])
    batch, is_prefill = s.schedule()
    assert not is_prefill and [q.seq_id for q in batch] == [0, 1]  # the third waits for a free seat


def test_newest_running_sequence_is_preempted_and_recomputed_later():
    s = _scheduler(num_blocks=4, block_size=4)
    a, b = _seq(0, 4), _seq(1, 4)
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()
    assert batch == [a, b] and s.block_manager.num_free_blocks == 2
    s.postprocess(batch, [5, 5])  # both now hold 5 tokens: each needs a second block to decode
    batch, _ = s.schedule()
    assert batch == [a, b] and s.block_manager.num_free_blocks == 0
    s.postprocess(batch, [6, 6])
    for _ in range(3):
        batch, _ = s.schedule()
        s.postprocess(batch, [6, 6])
    # 9 tokens each: feeding the ninth needs a third block each, and none is free.
    batch, is_prefill = s.schedule()
    assert not is_prefill and batch == [a]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and list(s.waiting) == [b]
    assert s.num_preemptions == 1 and len(b.output_token_ids) == 5  # b keeps what it generated
    a.params = SamplingParams(max_tokens=6)
    s.postprocess(batch, [1])  # a is done: its blocks come back
    assert a.status is SequenceStatus.FINISHED and s.block_manager.num_free_blocks == 4
    batch, is_prefill = s.schedule()
    assert is_prefill and batch == [b] and len(b.block_table) == 3  # recomputed over prompt + output


def test_a_sequence_the_whole_cache_cannot_hold_fails_instead_of_looping():
    # The engine refuses such a cache at start; the scheduler still never spins on one.
    s = _scheduler(num_blocks=2, block_size=4)
    seq = _seq(0, 8)
    s.add(seq)
    batch, _ = s.schedule()
    s.postprocess(batch, [3])
    with pytest.raises(RuntimeError, match="cannot be scheduled"):
        s.schedule()


@pytest.mark.parametrize("params, token, reason", [
    (dict(), 0, "stop"),  # the model's end-of-sequence token
    (dict(ignore_eos=True), 0, None),
    (dict(stop_token_ids=[42]), 42, "stop"),
    (dict(max_tokens=1), 5, "length"),
])
def test_stop_conditions(params, token, reason):
    s = _scheduler()
    seq = _seq(0, 3, **params)
    s.add(seq)
    batch, _ = s.schedule()
    finished = s.postprocess(batch, [token])
    assert seq.finish_reason == reason and (finished == [seq]) == (reason is not None)
    if reason:
        assert s.block_manager.num_free_blocks == 8 and not s.has_unfinished()


def test_sequence_stops_at_max_model_len():
    s = _scheduler(max_model_len=5)
    seq = _seq(0, 4, max_tokens=10)
    s.add(seq)
    batch, _ = s.schedule()
    assert s.postprocess(batch, [9]) == [seq] and seq.finish_reason == "length" and len(seq) == 5


def test_abort_frees_blocks_and_queues():
    s = _scheduler(num_blocks=2, block_size=4, max_num_seqs=1)
    a, b = _seq(0, 3), _seq(1, 3)
    s.add(a)
    s.add(b)
    s.schedule()
    s.abort([a, b])
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 2


# The engine launches step t+1 before it reads step t's tokens: the runner counts a launched
# token as in flight (seq.num_inflight += 1) and postprocess reads it a step later.


def test_in_flight_tokens_are_decoded_and_a_sequence_at_its_length_is_not_decoded_again():
    s = _scheduler()
    seq = _seq(0, 3, max_tokens=2)
    s.add(seq)
    s.schedule()  # prefill
    seq.num_inflight += 1
    batch, is_prefill = s.schedule()
    assert batch == [seq] and not is_prefill and seq.num_tokens == 4  # feeds the token still in flight
    seq.num_inflight += 1
    assert s.schedule() == ([], False)  # the two tokens in flight are its max_tokens
    s.postprocess([seq], [5])
    s.postprocess([seq], [6])
    assert seq.finish_reason == "length" and seq.output_token_ids == [5, 6] and seq.num_inflight == 0
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 8


def test_the_token_of_the_step_after_a_stop_is_dropped():
    s = _scheduler()
    seq = _seq(0, 3, max_tokens=8)
    s.add(seq)
    s.schedule()
    seq.num_inflight += 1
    s.schedule()  # scheduled again before the host has read the end-of-sequence token
    seq.num_inflight += 1
    assert s.postprocess([seq], [0]) == [seq]
    assert s.postprocess([seq], [9]) == []
    assert seq.output_token_ids == [0] and seq.finish_reason == "stop" and s.block_manager.num_free_blocks == 8


def test_a_sequence_preempted_with_its_last_token_in_flight_finishes_from_the_waiting_queue():
    s = _scheduler(num_blocks=2, block_size=4)
    a, b = _seq(0, 4), _seq(1, 4, max_tokens=1)
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()  # prefill, a block each
    for seq in batch:
        seq.num_inflight += 1
    batch, _ = s.schedule()  # a's fifth token needs a second block: b, the newest, is preempted
    assert batch == [a] and list(s.waiting) == [b]
    s.postprocess([a, b], [7, 7])
    assert b.status is SequenceStatus.FINISHED and b.output_token_ids == [7] and not s.waiting
    assert list(s.running) == [a]
