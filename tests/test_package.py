"""`import fuselab` reaches every subpackage the README writes as `fuselab.X`, without importing them eagerly."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("expr", ["fuselab.optim.FusedAdamW", "fuselab.graphs.graphed", "fuselab.kernels.rms_norm",
                                  "fuselab.LLM", "fuselab.SamplingParams", "fuselab.patch"])
def test_readme_names_are_reachable_after_import_fuselab(expr: str) -> None:
    out = subprocess.run([sys.executable, "-c", f"import fuselab; print(callable({expr}))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_import_fuselab_stays_light() -> None:
    code = "import sys, fuselab; print(sorted(m for m in ('fuselab.kernels', 'fuselab.engine', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_unknown_attribute_raises_attribute_error() -> None:
    import fuselab

    with pytest.raises(AttributeError, match="no_such_thing"):
        fuselab.no_such_thing  # noqa: B018


def test_bench_names_one_thing_whatever_was_imported_first() -> None:
    # A submodule import binds its name on the package: `fuselab.bench` is the benchmark subjects'
    # package, so the timing harness lives at fuselab.timing.bench only.
    code = ("import fuselab.bench.decode, fuselab, types; from fuselab.timing import bench; "
            "print(isinstance(fuselab.bench, types.ModuleType), callable(bench))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True True"
