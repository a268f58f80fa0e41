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
