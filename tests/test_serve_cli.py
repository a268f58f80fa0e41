"""`fuselab serve`: its help, its refusals, and what it hands uvicorn."""

from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")

from fuselab.cli import main  # noqa: E402


def test_help_names_the_endpoints_and_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("MODEL", "--host", "127.0.0.1", "--port", "--api-key", "--mode", "--max-num-seqs", "--quantization",
                 "not implemented", "/v1/chat/completions", "/metrics", "fuselab[serve]"):
        assert text in out, text


def test_quantization_other_than_none_is_refused(capsys):
    assert main(["serve", "tiny", "--quantization", "awq"]) == 2
    assert "not implemented in the engine yet" in capsys.readouterr().err


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
