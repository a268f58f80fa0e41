"""Optional Gluon paths: only a Triton without what they import leaves them out; our own bugs are raised."""

import pytest
from kernel_checks import kernel_module

from fuselab.kernels._common.optional import optional_gluon


def _module(tmp_path, monkeypatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize("source", [
    "from triton.experimental.gluon import no_such_name\n",  # an older Gluon
    "import triton.experimental.no_such_dialect\n",  # no Gluon at all
])
def test_what_this_triton_lacks_leaves_the_path_out(tmp_path, monkeypatch, source):
    assert optional_gluon(_module(tmp_path, monkeypatch, "gluon_path_on_another_triton", source)) is None


@pytest.mark.parametrize("source, error", [
    ("from fuselab.kernels._common.launch import no_such_helper\n", ImportError),
    ("import fuselab.kernels.no_such_module\n", ImportError),
    ("raise AttributeError('a bug at import')\n", AttributeError),
])
def test_our_own_errors_are_raised(tmp_path, monkeypatch, source, error):
    with pytest.raises(error):
        optional_gluon(_module(tmp_path, monkeypatch, "gluon_path_with_a_bug", source))


def test_the_hopper_paths_load_where_triton_has_gluon():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    assert kernel_module("cross_entropy").hopper is not None
    assert kernel_module("attention.flash_forward").hopper is not None
