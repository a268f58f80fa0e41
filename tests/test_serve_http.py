"""`fuselab serve` over real sockets on 127.0.0.1: the official openai client on both endpoints,
streamed and not; 200 concurrent streaming clients; disconnects freeing their KV blocks; errors
with their status and the server serving on; Prometheus metrics; the API key."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fuselab.engine import LLM, SamplingParams  # noqa: E402
from fuselab.serve.app import build_app  # noqa: E402
from serve_fixtures import ServerThread, chat_checkpoint, hf_tokenizer, wait_for  # noqa: E402

KEY = "sk-test-key"
MODEL = "tiny-chat"
MAX_MODEL_LEN = 1024


def _llm(path, **kwargs):
    return LLM(path, mode="eager", dtype="float32", max_model_len=MAX_MODEL_LEN, **kwargs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("serve") / "ckpt")


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The same model outside the server: what each request gives when run alone."""
    return _llm(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint):
    app = build_app(_llm(checkpoint, max_num_seqs=32), MODEL, api_key=KEY)
    with ServerThread(app) as running:
        running.app = app
        yield running


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def _alone(reference, prompt, max_tokens, **params):
    return reference.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params))[0]


def _post(server, path, body, key=KEY, timeout=30):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def _blocks_all_free(server) -> bool:
    llm = server.app.state.engine.llm
    return llm.scheduler.block_manager.num_free_blocks == llm.kv_cache.num_blocks


# --------------------------------------------------------------------------------------------
# The two endpoints through the openai client
# --------------------------------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_matches_the_engine_streamed_or_not(client, reference):
    expected = _alone(reference, "w5 w17 w200", 6)
    out = client.completions.create(model=MODEL, prompt="w5 w17 w200", max_tokens=6, temperature=0)
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 6, 9)
    chunks = list(client.completions.create(model=MODEL, prompt=[5, 17, 200], max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_uses_the_checkpoints_template(client, reference):
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w40 w41 w42"}]
    ids = hf_tokenizer().apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    expected = _alone(reference, ids, 5)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(ids) and out.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_and_stop_tokens_end_the_text_before_them(client, reference):
    alone = _alone(reference, "w9 w3", 8)
    stop = alone.text.split()[3]
    cut = alone.text[: alone.text.find(stop)]  # where the stop string first comes, perhaps inside a longer word
    out = client.completions.create(model=MODEL, prompt="w9 w3", max_tokens=8, temperature=0, stop=[stop, "zz"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="w9 w3", max_tokens=8, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut
    stop_id = alone.token_ids[3]
    before = alone.token_ids.index(stop_id)
    out = client.completions.create(model=MODEL, prompt="w9 w3", max_tokens=8, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id]})
    assert out.choices[0].text == reference.tokenizer.decode(alone.token_ids[:before])
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == before + 1  # counted, unshown


def test_seeded_sampling_repeats_and_top_k_is_taken(client):
    kwargs = dict(model=MODEL, prompt="w7", max_tokens=8, temperature=0.9, seed=123, extra_body={"top_k": 20})
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


# --------------------------------------------------------------------------------------------
# Many clients, and clients that leave
# --------------------------------------------------------------------------------------------


def test_200_concurrent_streams_each_equal_to_the_request_alone(server, reference):
    rng = random.Random(0)
    prompts = [[rng.randrange(252) for _ in range(rng.randrange(1, 30))] for _ in range(20)]
    expected = [_alone(reference, p, 6).text for p in prompts]

    async def one(client, i):
        stream = await client.completions.create(model=MODEL, prompt=prompts[i % 20], max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, usage = [], None
        async for chunk in stream:
            text += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        return "".join(text), usage.completion_tokens

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(200))), 60)

    results = asyncio.run(run())
    assert len(results) == 200
    assert [r[0] for r in results] == [expected[i % 20] for i in range(200)]
    assert all(r[1] == 6 for r in results)
    assert wait_for(lambda: _blocks_all_free(server))


def test_a_client_leaving_mid_stream_frees_its_blocks(server):
    metrics = server.app.state.metrics
    aborted = metrics.finished["abort"]
    body = {"model": MODEL, "prompt": "w1 w2 w3", "max_tokens": MAX_MODEL_LEN - 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        next(lines), next(lines)
        assert not _blocks_all_free(server)
    assert wait_for(lambda: metrics.finished["abort"] == aborted + 1 and _blocks_all_free(server))


def test_a_client_leaving_before_a_whole_response_frees_its_blocks(server):
    metrics = server.app.state.metrics
    aborted = metrics.finished["abort"]
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/v1/completions", {"model": MODEL, "prompt": "w4", "max_tokens": MAX_MODEL_LEN - 1},
              timeout=httpx.Timeout(30, read=0.3))
    assert wait_for(lambda: metrics.finished["abort"] == aborted + 1 and _blocks_all_free(server))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

BAD_REQUESTS = [  # (path, body, status, param, code)
    ("/v1/completions", "{not json", 400, None, None),
    ("/v1/completions", [1, 2], 400, None, None),
    ("/v1/completions", {"prompt": "w1"}, 400, "model", None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "w1"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 999]}, 400, "prompt", None),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "top_p": 2}, 400, "top_p", None),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "n": 2}, 400, "n", None),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "stop": 5}, 400, "stop", None),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "seed": -3}, 400, "seed", None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "w1"}]}, 400, "messages", None),
    ("/v1/nothing-here", {}, 404, None, None),
]


@pytest.mark.parametrize("path, body, status, param, code", BAD_REQUESTS)
def test_bad_requests_get_their_status_and_the_next_one_succeeds(server, path, body, status, param, code):
    response = _post(server, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    assert _post(server, "/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": 2}).status_code == 200


def test_the_api_key_is_required(server, client):
    assert _post(server, "/v1/completions", {"model": MODEL, "prompt": "w1"}, key="sk-wrong").status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics stay open
    assert client.completions.create(model=MODEL, prompt="w1", max_tokens=1).choices


def test_openai_client_sees_errors_as_its_exceptions(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="w1", temperature=-2)
    assert err.value.status_code == 400 and "temperature" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "w1"}])


def test_a_full_queue_answers_503(checkpoint):
    app = build_app(_llm(checkpoint, max_num_seqs=1), MODEL, max_waiting=0)
    body = {"model": MODEL, "prompt": "w1", "max_tokens": MAX_MODEL_LEN - 1, "stream": True}
    with ServerThread(app) as server:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as first:
            lines = first.iter_lines()  # held: dropping it would close the connection, and so end the request
            next(line for line in lines if line.startswith("data: "))
            busy = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "queue_full"
        assert wait_for(lambda: app.state.engine.stats().num_running == 0)
        ok = httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def test_metrics_parse_as_prometheus_text(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt="w2 w3", max_tokens=4, temperature=0)
    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("fuselab_requests_total", (("finish_reason", "length"),))] >= 1
    assert samples[("fuselab_prompt_tokens_total", ())] >= 2 and samples[("fuselab_generation_tokens_total", ())] >= 4
    assert families["fuselab_time_to_first_token_seconds"].type == "histogram"
    assert samples[("fuselab_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("fuselab_inter_token_latency_seconds_count", ())] >= 3
    assert 0 <= samples[("fuselab_kv_cache_usage_ratio", ())] <= 1
    assert ("fuselab_preemptions_total", ()) in samples and ("fuselab_requests_running", ()) in samples
