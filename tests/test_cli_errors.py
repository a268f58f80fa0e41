"""Bad command lines: every one is a one-line error naming the option, exit code 2, no traceback, and
is caught before any long work (a probe, a benchmark, reading weights)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine_checkpoints import build_hf_model, save_checkpoint
from fuselab.cli import build_parser, main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny checkpoint without tokenizer.json."""
    return save_checkpoint(build_hf_model("llama3"), tmp_path_factory.mktemp("cli") / "ckpt")


def _argparse_error(capsys, argv) -> str:
    """The error line of a command line argparse refuses (exit code 2)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def _engine_error(capsys, argv) -> str:
    """The one line `fuselab generate` prints for an option, model or checkpoint it refuses."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fuselab generate: error: ")
    return lines[0]


@pytest.fixture
def no_probe(monkeypatch):
    def run_probe(**kwargs):
        raise AssertionError("the probe ran before its options were checked")

    monkeypatch.setattr("fuselab.probe.run_probe", run_probe)


@pytest.mark.parametrize("option", ["--json", "--plot", "--markdown"])
def test_probe_output_in_a_missing_directory_is_refused_before_probing(capsys, tmp_path, no_probe, option):
    line = _argparse_error(capsys, ["probe", option, str(tmp_path / "missing" / "out")])
    assert line.startswith(f"fuselab probe: error: argument {option}: cannot write") and "No such file" in line


def test_probe_output_that_is_a_directory_is_refused(capsys, tmp_path, no_probe):
    line = _argparse_error(capsys, ["probe", "--json", str(tmp_path)])
    assert line == f"fuselab probe: error: argument --json: {str(tmp_path)!r} is a directory, not a file"


def test_checking_a_probe_output_path_leaves_no_file(tmp_path):
    path = tmp_path / "result.json"
    assert build_parser().parse_args(["probe", "--json", str(path)]).json == str(path)
    assert not path.exists()


@pytest.mark.parametrize("argv, option", [
    (["graphs", "--layers", "0"], "--layers"),
    (["graphs", "--width", "-3"], "--width"),
    (["graphs", "--rounds", "two"], "--rounds"),
    (["graphs", "--rep-ms", "nan"], "--rep-ms"),
    (["optim", "--rep-ms", "0"], "--rep-ms"),
    (["optim", "--warmup-ms", "-1"], "--warmup-ms"),
    (["decode", "--prompt-len", "0"], "--prompt-len"),
    (["decode", "--new-tokens", "1.5"], "--new-tokens"),
])
def test_bench_numeric_options_are_checked(capsys, argv, option):
    line = _argparse_error(capsys, ["bench", *argv])
    assert line.startswith(f"fuselab bench {argv[0]}: error: argument {option}: expected")


@pytest.mark.parametrize("subject", ["attention", "decode", "graphs", "kernels", "optim"])
def test_bench_out_that_is_a_file_is_refused(capsys, tmp_path, subject):
    file = tmp_path / "a-file"
    file.write_text("")
    line = _argparse_error(capsys, ["bench", subject, "--out", str(file / "results")])
    assert f"argument --out: {str(file)!r} (in " in line and "is not a directory" in line


def test_bench_out_that_does_not_exist_yet_is_accepted_and_not_created(tmp_path):
    out = tmp_path / "new" / "results"
    assert build_parser().parse_args(["bench", "graphs", "--out", str(out)]).out == str(out)
    assert not (tmp_path / "new").exists()


def test_generate_takes_token_ids(capsys):
    assert main(["generate", "--model", "tiny", "--prompt-ids", "72,105", "--max-tokens", "3", "--mode", "eager"]) == 0
    assert "3 tokens, finish: length" in capsys.readouterr().err


def test_generate_prints_token_ids_for_a_checkpoint_without_tokenizer(capsys, checkpoint):
    argv = ["generate", "--model", str(checkpoint), "--max-tokens", "4", "--mode", "eager"]
    assert main([*argv, "--prompt-ids", "1,2,3"]) == 0
    streamed = capsys.readouterr().out.split()
    assert len(streamed) == 4 and all(t.isdigit() for t in streamed)
    assert main([*argv, "--prompt-ids", "1,2,3", "--prompt-ids", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "--- [1, 2, 3]" and out[1].split() == streamed and out[2] == "--- [4]"


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,x"], "argument --prompt-ids: expected comma-separated ints, got '1,x'"),
    (["--prompt-ids", "1,-2"], "argument --prompt-ids: token ids must be >= 0"),
    (["--prompt-ids", "1", "--prompt", "hi"], "argument --prompt: not allowed with argument --prompt-ids"),
    ([], "one of the arguments --prompt --prompt-ids is required"),
])
def test_generate_prompt_options_are_checked(capsys, args, message):
    line = _argparse_error(capsys, ["generate", "--model", "tiny", *args])
    assert line.startswith(f"fuselab generate: error: {message}")


def test_generate_token_ids_outside_the_vocabulary_are_refused_before_loading(capsys, monkeypatch, checkpoint):
    monkeypatch.setattr("fuselab.engine.runner.load_checkpoint", lambda *a: pytest.fail("weights were read"))
    line = _engine_error(capsys, ["generate", "--model", str(checkpoint), "--prompt-ids", "5,256"])
    assert line.endswith("argument --prompt-ids: token id 256 is outside the model's vocabulary [0, 256)")


def test_generate_text_prompt_without_a_tokenizer_points_at_prompt_ids(capsys, checkpoint):
    line = _engine_error(capsys, ["generate", "--model", str(checkpoint), "--prompt", "hi"])
    assert "argument --prompt:" in line and "no tokenizer.json" in line and "--prompt-ids" in line


def test_generate_broken_checkpoint_is_one_line_naming_the_file(capsys, checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoint / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes()[:1000])
    line = _engine_error(capsys, ["generate", "--model", str(broken), "--prompt-ids", "1", "--mode", "eager"])
    assert line.startswith(f"fuselab generate: error: checkpoint {broken / 'model.safetensors'}: not a readable")


def test_errors_from_the_installed_command_carry_no_traceback(tmp_path):
    (tmp_path / "config.json").write_text("[]")
    for argv, line in [
        (["probe", "--json", str(tmp_path / "missing" / "x.json")], "fuselab probe: error: argument --json: cannot"),
        (["generate", "--model", str(tmp_path), "--prompt-ids", "1"],
         f"fuselab generate: error: {tmp_path / 'config.json'}: expected a JSON object, got a list"),
    ]:
        proc = subprocess.run([sys.executable, "-m", "fuselab", *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(line)
