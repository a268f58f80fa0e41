"""The exact line behind each host sync: the user frame of a captured stack, the sites recorded while profiling,
and which lines are only the profiler's approximation."""

import os
import warnings

import pytest
import torch

import doctor_traces as dt
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.fixes import APPROXIMATE_LINE
from fuselab.doctor.profile import record_trace
from fuselab.doctor.sync_sites import SYNC_SITE, SYNC_WARNING, SyncSiteRecorder, library_dirs, user_frame
from fuselab.doctor.trace import load_trace

LIBS = ("/opt/venv/lib/python3.12/site-packages/", "/usr/lib/python3.12/", "/src/fuselab/fuselab/")


@pytest.mark.parametrize("stack, frame", [
    ([("/opt/venv/lib/python3.12/site-packages/torch/_tensor.py", 40, "wrapped"), ("/work/train.py", 42, "loop"),
      ("/work/train.py", 60, "<module>")], ("/work/train.py", 42, "loop")),
    ([("/usr/lib/python3.12/warnings.py", 10, "_showwarnmsg"), ("/src/fuselab/fuselab/doctor/sync_sites.py", 70, "_show"),
      ("/opt/venv/lib/python3.12/site-packages/transformers/generation/utils.py", 2500, "_sample"),
      ("/work/serve.py", 7, "main")], ("/work/serve.py", 7, "main")),
    ([("<frozen runpy>", 88, "_run_code"), ("/work/model.py", 12, "forward")], ("/work/model.py", 12, "forward")),
    ([("/usr/lib/python3.12/runpy.py", 88, "_run_code")], None),
])
def test_user_frame_is_the_innermost_outside_the_libraries(stack, frame):
    assert user_frame(stack, LIBS) == frame


def test_library_dirs_hold_torch_and_fuselab():
    import fuselab

    dirs = library_dirs()
    for module in (torch, fuselab):
        assert any(os.path.realpath(module.__file__).startswith(d) for d in dirs)
    assert all(d.endswith(os.sep) for d in dirs)
    assert not any(os.path.realpath(__file__).startswith(d) for d in dirs)  # the tests are the user's code here


def _line_of(marker: str) -> int:
    return next(n for n, line in enumerate(open(__file__).read().splitlines(), 1) if marker in line)


def _sync_in_a_loop(x):
    for _ in range(3):
        warnings.warn(SYNC_WARNING)  # sync-site: loop
    return x


@pytest.mark.filterwarnings("ignore:called a synchronizing")  # the call before the steps runs unrecorded
def test_recorder_marks_each_sync_with_its_line_under_the_profiler(tmp_path):
    path = record_trace(lambda: _sync_in_a_loop(torch.ones(2)), tmp_path / "t.json", steps=2, warmup=0)
    sites = [a.name for a in load_trace(path).annotations if a.name.startswith(SYNC_SITE)]
    assert sites == [f"{SYNC_SITE}{__file__}:{_line_of('# sync-site: loop')} (_sync_in_a_loop)"] * 6


def test_a_sync_inside_a_library_is_placed_at_the_calling_line(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "somelib.py").write_text(f"import warnings\n\ndef read_back():\n    warnings.warn({SYNC_WARNING!r})\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("somelib", lib / "somelib.py")
    somelib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(somelib)
    marks = []
    with SyncSiteRecorder(libraries=library_dirs() + (str(lib) + "/",), on_site=marks.append):
        somelib.read_back()  # sync-site: through a library
    assert marks == [(__file__, _line_of("# sync-site: through a library"), "test_a_sync_inside_a_library_is_placed_at_the_calling_line")]


def test_other_warnings_still_reach_the_user():
    with pytest.warns(UserWarning, match="something else"):
        with SyncSiteRecorder():
            warnings.warn("something else")


def test_recorded_sites_give_exact_lines(tmp_path):
    d = analyze_trace(dt.sync_bound_with_sites().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    syncs = d.analysis.syncs[0]
    items = [s for s in syncs if s.cause == "`.item()`"]
    assert len(items) == 10 and {(s.source, s.source_exact) for s in items} == {("train.py:47 (loop)", True)}
    (explicit,) = [s for s in syncs if s.cause == "`torch.cuda.synchronize()`"]
    assert not explicit.source_exact
    item_fix = next(f for f in d.fixes if "`.item()`" in f.action)
    assert "train.py:47 (loop)" in item_fix.action and APPROXIMATE_LINE not in item_fix.action
    assert d.to_dict()["syncs"][0]["source_exact"] is True


def test_lines_from_the_profilers_stacks_are_marked_approximate(tmp_path):
    d = analyze_trace(dt.sync_bound().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    assert APPROXIMATE_LINE in d.fixes[0].action
    assert any("not the statement" in e and "fuselab doctor SCRIPT" in e for e in d.evidence)


def test_a_site_far_from_any_sync_is_ignored(tmp_path):
    b = dt.sync_bound(steps=1)
    b.annotation(f"{SYNC_SITE}train.py:99 (late)", 900.0, 0.0)  # within SITE_DELAY_US of the last sync
    b.annotation(f"{SYNC_SITE}train.py:98 (early)", -50.0, 0.0)  # before any sync
    syncs = analyze_trace(b.write(tmp_path / "t.json"), ceilings=STATED_CEILINGS).analysis.syncs[0]
    assert [s.source for s in syncs if s.source_exact] == ["train.py:99 (late)"]  # the last sync before it


def test_recorder_leaves_the_scripts_own_warning_filters():
    before = list(warnings.filters)
    recorder = SyncSiteRecorder(on_site=lambda frame: None)
    recorder.start()
    warnings.filterwarnings("ignore", category=FutureWarning)  # what a script might do while it is profiled
    recorder.stop()
    assert warnings.filters[0][:3] == ("ignore", None, FutureWarning) and warnings.filters[1:] == before
    warnings.filters.pop(0)
