"""`fuselab doctor --compare BEFORE AFTER`: the parts side by side, the verdict change, what went away."""

import json
from pathlib import Path

import pytest

import doctor_traces as dt
from fuselab.cli import main
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.compare import compare, compare_reports, sync_site

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"


def _metric(c, name):
    return next(m for m in c.metrics if m.name == name)


def test_a_removed_sync_shows_as_gone(tmp_path):
    before = dt.sync_bound().write(tmp_path / "before.json")
    after = dt.memory_bound().write(tmp_path / "after.json.gz")
    c = compare(before, after, ceilings=STATED_CEILINGS)
    assert (c.verdict_before, c.verdict_after) == ("sync-bound", "memory-bound")
    assert (c.step.before, c.step.after, c.step.change) == (1000.0, 128.0, -872.0)
    assert (_metric(c, "sync stalls").before, _metric(c, "sync stalls").after) == (775.0, 0.0)
    assert (_metric(c, "syncs").before, _metric(c, "syncs").after) == (10, 0)
    assert c.syncs.gone == {"`.item()` at train.py (loop)": (10.0, 0.0)}
    assert c.kernels.gone == {"sm90_xmma_gemm_bf16bf16_bf16f32": (10.0, 0.0)}
    assert c.ops.gone == {"aten::mm": (10.0, 0.0)} and c.ops.new == {"aten::mul": (0.0, 4.0)}


def test_a_doctor_json_reads_the_same_as_its_trace(tmp_path):
    trace = dt.launch_bound().write(tmp_path / "t.json")
    report = tmp_path / "d.json"
    report.write_text(json.dumps(analyze_trace(trace, ceilings=STATED_CEILINGS).to_dict()))
    from_trace = compare(trace, dt.graph_replay().write(tmp_path / "g.json"), ceilings=STATED_CEILINGS).to_dict()
    from_json = compare(report, tmp_path / "g.json", ceilings=STATED_CEILINGS).to_dict()
    from_json.pop("before"), from_trace.pop("before")
    assert from_json == from_trace


def test_the_same_run_twice_changes_nothing():
    path = FIXTURES / "sync_bound.json.gz"
    c = compare(path, path, ceilings=STATED_CEILINGS)
    assert c.verdict_before == c.verdict_after == "sync-bound"
    assert all(m.change == 0 for m in c.metrics)
    for diff in (c.kernels, c.ops, c.syncs):
        assert not (diff.gone or diff.new or diff.fewer or diff.more)


def test_sync_sites_match_by_file_and_function_not_line():
    assert sync_site({"cause": "`.item()`", "source": "train.py:42 (loop)"}) == "`.item()` at train.py (loop)"
    assert sync_site({"cause": "`.item()`", "source": None}) == "`.item()`"
    base = {"verdict": "sync-bound", "wall_us_per_step": 100.0, "steps": 2}
    before = base | {"syncs": [{"cause": "`.item()`", "source": "train.py:42 (loop)"},
                               {"cause": "`.cpu()`", "source": "train.py:50 (loop)"}] * 2}
    after = base | {"syncs": [{"cause": "`.item()`", "source": "train.py:41 (loop)"}] * 2}  # a line above it went
    c = compare_reports(before, after)
    assert c.syncs.gone == {"`.cpu()` at train.py (loop)": (1.0, 0.0)} and not c.syncs.new and not c.syncs.fewer


def test_cli_compare_prints_and_writes_json(tmp_path, capsys):
    before = dt.sync_bound().write(tmp_path / "before.json")
    after = dt.memory_bound().write(tmp_path / "after.json")
    out = tmp_path / "change.json"
    assert main(["doctor", "--compare", str(before), str(after), "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "sync-bound → memory-bound" in printed and "7.81x faster" in printed
    assert "syncs gone" in printed and "`.item()` at train.py (loop): 10 → 0" in printed
    data = json.loads(out.read_text())
    assert data["verdict"] == {"before": "sync-bound", "after": "memory-bound"}
    assert data["syncs"]["gone"] == [{"name": "`.item()` at train.py (loop)", "before": 10.0, "after": 0.0}]


def test_help_explains_the_new_flags(capsys):
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--compare BEFORE AFTER", "--perfetto PATH", "zooms", "top kernels", "record_function", "NCCL"):
        assert text in out


@pytest.mark.parametrize("argv, message", [
    (["--compare", "a.json", "b.json", "--trace", "t.json"], "give no --trace or SCRIPT"),
    (["--compare", "a.json", "b.json", "--html", "r.html"], "describe one run"),
    (["--compare", "/nonexistent/a.json", "/nonexistent/b.json"], "no such file"),
])
def test_cli_compare_rejects_bad_input(argv, message, capsys):
    assert main(["doctor", *argv]) == 2
    assert message in " ".join(capsys.readouterr().out.split())
