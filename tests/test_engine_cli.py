"""`fuselab generate` on a CPU-only machine: the tiny preset, several prompts, errors, help."""

from __future__ import annotations

import pytest

from fuselab.cli import main


def test_generate_streams_from_the_tiny_preset(capsys):
    assert main(["generate", "--model", "tiny", "--prompt", "Hello, fuselab", "--max-tokens", "5", "--mode", "eager"]) == 0
    err = capsys.readouterr().err
    assert "5 tokens, finish: length" in err and "time to first token" in err


def test_generate_batches_several_prompts(capsys):
    argv = ["generate", "--model", "tiny", "--prompt", "one", "--prompt", "two", "--max-tokens", "3",
            "--temperature", "0.8", "--top-k", "10", "--seed", "1", "--mode", "eager"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "--- 'one'" in captured.out and "--- 'two'" in captured.out
    assert captured.err.count("3 tokens") == 2


def test_generate_reports_bad_arguments(capsys):
    assert main(["generate", "--model", "no-such-model", "--prompt", "x"]) == 2
    assert "neither a checkpoint directory nor a preset" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--prompt", "x", "--top-p", "2", "--mode", "eager"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_generate_help_explains_presets_and_modes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--max-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--mode", "UTF-8 bytes", "llama3-8b",
                 "--prompt-ids"):
        assert text in out
