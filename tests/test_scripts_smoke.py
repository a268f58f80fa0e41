"""CPU smoke tests of scripts/: each answers --help, the ones that run without a GPU run at a tiny size, and the
ones that need a GPU say so instead of failing."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
PYTHON_SCRIPTS = sorted(p.name for p in SCRIPTS.iterdir() if p.is_file() and p.read_text().startswith("#!/usr/bin/env python3"))
NEEDS_GPU = ("doctor-before-after", "hf-generate-variants", "profile-decode", "tune-decode-step", "tune-gate-up-swiglu",
             "tune-kernels")
needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour of a GPU script")


def run_script(name: str, *args: str, monkeypatch) -> int:
    """Run scripts/NAME in this process as `python scripts/NAME ARGS...`; its exit code."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / name), *args])
    try:
        runpy.run_path(str(SCRIPTS / name), run_name="__main__")
    except SystemExit as exit:
        return 0 if exit.code is None else exit.code
    return 0


def test_every_python_script_is_listed():
    assert set(NEEDS_GPU) < set(PYTHON_SCRIPTS)
    assert {"bench-doctor-analysis", "host-cost", "record-doctor-fixtures"} < set(PYTHON_SCRIPTS)


@pytest.mark.parametrize("name", PYTHON_SCRIPTS)
def test_script_answers_help(name, monkeypatch, capsys):
    assert run_script(name, "--help", monkeypatch=monkeypatch) == 0
    out = capsys.readouterr().out
    assert name in out or "usage" in out.lower(), out


@needs_cpu_only
@pytest.mark.parametrize("name", NEEDS_GPU)
def test_gpu_script_says_it_needs_a_gpu(name, monkeypatch, capsys, tmp_path):
    args = [str(tmp_path)] if name == "doctor-before-after" else []
    assert run_script(name, *args, monkeypatch=monkeypatch) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())


def test_bench_doctor_analysis_times_a_small_trace(monkeypatch, capsys):
    assert run_script("bench-doctor-analysis", "0.5", monkeypatch=monkeypatch) == 0
    out = capsys.readouterr().out
    assert "analyze_trace took" in out and "verdict launch-bound" in out


def test_host_cost_runs_on_the_cpu():
    # A subprocess: the script stubs out the kernel modules' launchers for the rest of its process.
    proc = subprocess.run([sys.executable, str(SCRIPTS / "host-cost"), "--calls", "5"], capture_output=True, text=True,
                          cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "rms_norm + residual 1x4096" in proc.stdout and "decode_attention batch 1" in proc.stdout


@needs_cpu_only
def test_gpu_check_runs_a_bench_stage_into_the_results_folder(tmp_path):
    # The script calls `python3`: this interpreter's, as a user's activated environment would give it.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = os.environ | {"PATH": path, "FUSELAB_RESULTS": str(tmp_path / "results"), "FUSELAB_STAGES": "bench",
                        "FUSELAB_BENCH": "graphs"}
    proc = subprocess.run(["bash", str(SCRIPTS / "gpu-check")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"results in {tmp_path / 'results'}" in proc.stdout
    assert "needs a CUDA GPU" in (tmp_path / "results" / "bench-graphs.txt").read_text()
