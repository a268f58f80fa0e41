import subprocess
import sys

import pytest

from fuselab.cli import build_parser, main


def test_top_level_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "probe" in out and "launch" in out


def test_probe_help_explains_itself(capsys):
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag in ("--json", "--plot", "--quick"):
        assert flag in out
    assert "CUDA graph" in out


def test_unknown_command_is_rejected(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2


def test_every_subcommand_has_help():
    parser = build_parser()
    actions = [a for a in parser._subparsers._group_actions]  # noqa: SLF001 - argparse exposes no public walk
    for name, sub in actions[0].choices.items():
        assert sub.description, f"`fuselab {name}` has no description"


def test_console_entry_point_runs_as_module():
    proc = subprocess.run([sys.executable, "-m", "fuselab", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and "fuselab" in proc.stdout


def test_bench_help_lists_every_subject(capsys):
    from fuselab.cli import BENCH_SUBJECTS

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for subject in BENCH_SUBJECTS:
        assert subject in out
        with pytest.raises(SystemExit) as exc:
            main(["bench", subject, "--help"])
        assert exc.value.code == 0


def test_every_bench_subject_says_it_needs_a_gpu_on_a_cpu_machine(tmp_path, capsys):
    import torch

    from fuselab.cli import BENCH_SUBJECTS

    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    for subject in BENCH_SUBJECTS:
        assert main(["bench", subject, "--out", str(tmp_path)]) == 0
        assert "needs a CUDA GPU" in capsys.readouterr().out, subject
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written
