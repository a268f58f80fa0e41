"""`fuselab serve`: its help, its refusals, and what it hands uvicorn."""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")

from fuselab.cli import main  # noqa: E402
from fuselab.engine import LLM, SamplingParams  # noqa: E402


def test_help_names_the_endpoints_and_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("MODEL", "--host", "127.0.0.1", "--port", "--api-key", "--mode", "--max-num-seqs", "--quantization",
                 "int4", "fp8", "--tensor-parallel-size", "/v1/chat/completions", "/metrics", "fuselab[serve]"):
        assert text in out, text


def test_an_unknown_quantization_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "tiny", "--quantization", "awq"])
    assert exc.value.code == 2 and "invalid choice: 'awq'" in capsys.readouterr().err


def _served(monkeypatch, *args):
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append(app))
    assert main(["serve", "tiny", "--mode", "eager", "--max-model-len", "64", *args]) == 0
    return calls[0]


def test_serve_quantizes_the_model_it_serves(monkeypatch):
    from fastapi.testclient import TestClient

    app = _served(monkeypatch, "--quantization", "int8")
    assert app.state.engine.llm.engine_config.quantization.fmt == "int8"
    with TestClient(app) as client:
        body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0}
        assert len(client.post("/v1/completions", json=body).json()["choices"][0]["text"]) > 0


def test_serve_splits_the_model_over_ranks(monkeypatch):
    from fastapi.testclient import TestClient

    app = _served(monkeypatch, "--tensor-parallel-size", "2")
    llm = app.state.engine.llm
    try:
        with TestClient(app) as client:
            body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0}
            reply = client.post("/v1/completions", json=body).json()
            assert reply["usage"]["completion_tokens"] == 4
            alone = LLM("tiny", mode="eager", max_model_len=64).generate([[3, 4, 5]], SamplingParams(temperature=0,
                                                                                                   max_tokens=4))
            assert reply["choices"][0]["text"] == alone[0].text
            assert "fuselab_kv_cache_blocks" in client.get("/metrics").text
    finally:
        llm.close()


def test_a_bad_model_is_refused(capsys):
    assert main(["serve", "no-such-model"]) == 2
    assert "neither a checkpoint directory nor a preset" in capsys.readouterr().err


def test_serve_hands_uvicorn_the_app_on_localhost(monkeypatch):
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append((app, kwargs)))
    monkeypatch.setenv("FUSELAB_API_KEY", "sk-env")
    assert main(["serve", "tiny", "--port", "8123", "--max-num-seqs", "3", "--mode", "eager",
                 "--max-model-len", "64", "--served-model-name", "small"]) == 0
    (app, kwargs), = calls
    assert kwargs["host"] == "127.0.0.1" and kwargs["port"] == 8123
    engine = app.state.engine
    assert engine.llm.engine_config.max_num_seqs == 3 and engine.llm.max_model_len == 64

    from fastapi.testclient import TestClient

    with TestClient(app) as client:  # runs the lifespan: the engine thread starts and stops with it
        assert client.get("/v1/models").status_code == 401
        models = client.get("/v1/models", headers={"Authorization": "Bearer sk-env"}).json()
        assert [m["id"] for m in models["data"]] == ["small"]
    assert not engine.alive
