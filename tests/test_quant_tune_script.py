"""scripts/tune-quant-gemv on a CPU: --smoke checks every variant at a tiny shape through the interpreter
and writes its JSON and Markdown; without --smoke it says it needs a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "tune-quant-gemv"


def _run(*args: str) -> subprocess.CompletedProcess:
    # A subprocess: the script sets up Triton's interpreter itself, as a user's run would.
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ | {"PYTHONPATH": str(ROOT)}, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour of a GPU script")
def test_smoke_checks_every_variant_and_writes_the_results(tmp_path):
    proc = _run("--smoke", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "tune-quant-gemv.json").read_text())
    paths = {(r["format"], r["m"], r["path"]) for r in result["results"]}
    assert {("int4", 1, "gemv"), ("int8", 4, "mma"), ("fp8", 4, "dequantize+cublas"), ("int4-g32", 1, "engine"),
            ("fp8", 4, "fp8 W8A8 triton"), ("fp8", 16, "fp8 W8A8 triton"), ("int8", 16, "int8 W8A8 triton"),
            ("int8", 1, "int8 W8A8 triton"), ("fp8", 1, "fp8 W8A8 triton")} <= paths
    assert sum(r["path"] == "fp8 W8A8 triton" and r["m"] == 16 for r in result["results"]) > 1  # the rule and others
    assert sum(r["path"] == "int8 W8A8 triton" and r["m"] == 16 for r in result["results"]) > 1
    assert all(r["ok"] for r in result["results"]), [r for r in result["results"] if not r["ok"]]
    text = (tmp_path / "tune-quant-gemv.md").read_text()
    assert "## The engine's dispatch" in text and "## Fastest config of each case" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour of a GPU script")
def test_without_smoke_it_needs_a_gpu(tmp_path):
    proc = _run("--out", str(tmp_path / "out"))
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_help_lists_the_shapes_and_options():
    proc = _run("--help")
    assert proc.returncode == 0
    for text in ("--smoke", "--formats", "--shapes", "--rows", "--quick", "--out"):
        assert text in proc.stdout


def test_one_row_sweeps_the_gemm_grid_unless_quick():
    # The one-row crossover between the GEMVs and the tensor-core kernel is read from a sweep of the
    # kernel's configs at M = 1, not its rule alone.
    code = (f"import importlib.machinery, sys; sys.argv = ['tune-quant-gemv']; "
            f"m = importlib.machinery.SourceFileLoader('tqg', {str(SCRIPT)!r}).load_module(); "
            f"print(len(m.gemm_configs('int4', 1, 28672, 512, False, 132)[1]), "
            f"len(m.gemm_configs('int4', 1, 28672, 512, True, 132)[1]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=os.environ | {"PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    full, quick = map(int, proc.stdout.split())
    assert quick == 1 and full > 20
