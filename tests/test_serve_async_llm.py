"""AsyncLLM, the engine's request loop: requests join a running batch, stream their text, stop
at stop strings, free their blocks when aborted; and TextStream, its incremental detokenizer."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from fuselab.engine import LLM, SamplingParams
from fuselab.engine.async_llm import AsyncLLM, EngineBusy, EngineDead, TextStream
from fuselab.engine.tokenizer import ByteTokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ALPHABET = "ab€é\n"  # one-, two- and three-byte characters


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", mode="eager", max_num_seqs=4, max_model_len=512)


@pytest.fixture
def engine(llm):
    engine = AsyncLLM(llm, max_waiting=2).start()
    yield engine
    engine.close()


async def _read(stream):
    deltas = [d async for d in stream]
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason


def _all_free(llm) -> bool:
    return llm.scheduler.block_manager.num_free_blocks == llm.kv_cache.num_blocks


# --------------------------------------------------------------------------------------------
# TextStream
# --------------------------------------------------------------------------------------------


def _stream_text(ids, stop=()):
    """(text handed out, whether a stop string ended it) for ids fed one at a time."""
    stream, out = TextStream(ByteTokenizer(), stop), []
    for token in ids:
        if stream.add(token):
            return "".join(out) + stream.take(final=True), True
        out.append(stream.take(final=False))
    hit = stream.finish()
    return "".join(out) + stream.take(final=True), hit


def test_partial_characters_wait_for_their_other_bytes():
    stream = TextStream(ByteTokenizer())
    pieces = []
    for token in "a€b".encode():
        stream.add(token)
        pieces.append(stream.take(final=False))
    assert pieces == ["a", "", "", "€", "b"]


def test_stop_strings_across_tokens_cut_the_text_before_them():
    assert _stream_text(list(b"hello world"), stop=("o w",)) == ("hell", True)
    assert _stream_text(list(b"hello world"), stop=("xyz", "ld")) == ("hello wor", True)
    assert _stream_text(list(b"hello"), stop=("lo!",)) == ("hello", False)  # held back, then handed out


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=30),
       stop=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), max_size=2))
def test_streamed_text_is_the_decoded_text_up_to_the_first_stop(text, stop):
    full = text.encode().decode()
    out, hit = _stream_text(list(text.encode()), tuple(stop))
    assert full.startswith(out) and not any(s in out for s in stop)
    if hit:
        assert any(full[len(out):].startswith(s) for s in stop)
    else:
        assert out == full and not any(s in full for s in stop)


# --------------------------------------------------------------------------------------------
# AsyncLLM
# --------------------------------------------------------------------------------------------


def test_requests_stream_the_tokens_generate_gives(engine, llm):
    prompts = ["one", "two, longer", [5, 6, 7]]

    async def run():
        return await asyncio.gather(*(_read(engine.submit(p, GREEDY)) for p in prompts))

    results = asyncio.run(run())
    engine.close()  # the engine thread owns the LLM: done with it before generate runs here
    expected = llm.generate(prompts, GREEDY)
    assert [(r[0], r[1], r[2]) for r in results] == [(o.text, o.token_ids, "length") for o in expected]


def test_a_request_joins_a_running_batch(engine):
    async def run():
        long = engine.submit("long", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        await anext(long)
        short = await _read(engine.submit("short", GREEDY))
        running = engine.stats().num_running
        long.abort()
        return short, running

    short, running_after = asyncio.run(run())
    assert len(short[1]) == 8 and running_after == 1  # the long one was still running when the short one ended


def test_an_aborted_request_frees_its_blocks(engine, llm):
    async def run():
        stream = engine.submit("x", SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))
        async with stream:
            await anext(stream)
            assert not _all_free(llm)
        for _ in range(500):
            if _all_free(llm):
                return True
            await asyncio.sleep(0.01)

    assert asyncio.run(run())


def test_stop_strings_finish_with_stop(engine):
    async def run():
        text, _, _ = await _read(engine.submit([1, 2, 3], GREEDY))
        stop = text[2:4]
        return text, await _read(engine.submit([1, 2, 3], GREEDY, stop=[stop])), stop

    text, (cut, tokens, reason), stop = asyncio.run(run())
    assert cut == text[: text.find(stop)] and reason == "stop" and len(tokens) <= 8


def test_bad_requests_and_a_full_engine_raise_at_submit(engine):
    async def full():
        with pytest.raises(ValueError, match="prompt holds token id 9999"):
            engine.submit([9999], GREEDY)
        with pytest.raises(ValueError, match="stop"):
            engine.submit("x", GREEDY, stop=[""])
        streams = [engine.submit("x", SamplingParams(max_tokens=400, ignore_eos=True)) for _ in range(6)]
        with pytest.raises(EngineBusy):
            engine.submit("x", GREEDY)  # max_num_seqs 4 + max_waiting 2
        for s in streams:
            s.abort()

    asyncio.run(full())


def test_close_ends_unfinished_requests_with_abort(llm):
    engine = AsyncLLM(llm).start()

    async def run():
        stream = engine.submit("x", SamplingParams(max_tokens=500, ignore_eos=True))
        await anext(stream)
        await asyncio.get_running_loop().run_in_executor(None, engine.close)
        reasons = [d.finish_reason async for d in stream]
        with pytest.raises(EngineDead):
            engine.submit("x", GREEDY)
        return reasons

    assert asyncio.run(run())[-1] == "abort"
    assert _all_free(llm)


def test_an_engine_thread_that_fails_ends_its_requests_and_refuses_new_ones(llm, monkeypatch):
    def broken_step():
        raise RuntimeError("the device went away")

    monkeypatch.setattr(llm, "step", broken_step)
    engine = AsyncLLM(llm).start()

    async def run():
        stream = engine.submit("x", GREEDY)
        with pytest.raises(EngineDead):
            await asyncio.wait_for(anext(stream), timeout=30)
        engine._thread.join(timeout=30)
        with pytest.raises(EngineDead, match="device went away"):
            engine.submit("x", GREEDY)

    asyncio.run(run())
