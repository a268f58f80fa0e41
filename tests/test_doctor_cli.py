"""`fuselab doctor` on the command line, its reports, and profiling (the host side runs on any machine)."""

import json
from types import SimpleNamespace

import pytest
import torch

import doctor_traces as dt
from fuselab.cli import main
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import diagnose, step
from fuselab.doctor.analyze import analyze_file
from fuselab.doctor.html import write_html
from fuselab.doctor.profile import profile_script, record_trace
from fuselab.doctor.trace import load_trace
from fuselab.doctor.verdict import verdict_for


def test_help_explains_both_modes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--trace", "--json", "--html", "--probe", "SCRIPT", "fuselab.doctor.step()", "launch-bound", "sync-bound"):
        assert text in out


def test_trace_mode_writes_json_and_html(tmp_path, capsys):
    trace = dt.sync_bound().write(tmp_path / "t.json.gz")
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"ceilings": {"copy_bandwidth_gbs": 4000.0, "bf16_tflops": 800.0}}))
    out_json, out_html = tmp_path / "d.json", tmp_path / "d.html"
    assert main(["doctor", "--trace", str(trace), "--json", str(out_json), "--html", str(out_html), "--probe", str(probe)]) == 0
    printed = capsys.readouterr().out
    assert "sync-bound" in printed and "train.py:42" in printed
    data = json.loads(out_json.read_text())
    assert data["verdict"] == "sync-bound" and data["syncs_per_step"] == 10
    assert data["ceilings"]["copy_bandwidth_gbs"] == 4000.0 and str(probe) in data["ceilings"]["source"]
    page = out_html.read_text()
    assert page.count("<svg") == 2 and "src=" not in page  # self-contained: nothing to fetch
    assert page.count("`.item()` at train.py:42 (loop): blocked 19.0 us") == 10  # the median step's syncs on the timeline


def test_trace_mode_reports_bad_input_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    assert main(["doctor", "--trace", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().out
    assert main(["doctor", "--trace", str(dt.cpu_only().write(tmp_path / "cpu.json"))]) == 2
    assert "no GPU events" in capsys.readouterr().out


def test_warmup_that_skips_every_step_is_refused(tmp_path, capsys):
    trace = dt.launch_bound(steps=3).write(tmp_path / "t.json")
    assert main(["doctor", "--trace", str(trace), "--warmup", "999"]) == 2
    out = capsys.readouterr().out
    assert "--warmup" in out and "3 steps" in out
    assert main(["doctor", "--trace", str(trace), "--warmup", "2"]) == 0


def test_needs_exactly_one_of_trace_or_script(tmp_path, capsys):
    assert main(["doctor"]) == 2
    assert main(["doctor", "--trace", "t.json", "script.py"]) == 2
    assert "either --trace FILE or SCRIPT" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_script_mode_without_cuda_says_why(tmp_path, capsys):
    script = tmp_path / "work.py"
    script.write_text("print('ran')\n")
    assert main(["doctor", str(script)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "needs CUDA" in out and "--trace" in out and "ran" not in out


def test_html_timeline_marks_kernels_and_gaps(tmp_path):
    d = verdict_for(analyze_file(dt.launch_bound().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS))
    write_html(d, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert page.count("memory-bound") >= 98  # every kernel of the median step, with its roofline side
    assert page.count("idle 8.0 us: launch") == 97
    assert "GPU 0 stream 7" in page


@pytest.mark.parametrize("kwargs, error, message", [
    ({"fn": 3}, TypeError, "fn must be a callable"),
    ({"steps": 0}, ValueError, "steps must be an int >= 1"),
    ({"warmup": -1}, ValueError, "warmup must be an int >= 0"),
    ({"batch_scale": 10}, TypeError, "batch_scale must be a callable"),
    ({"ceilings": 1.5}, TypeError, "ceilings must be"),
    ({"ceilings": "/nonexistent/probe.json"}, FileNotFoundError, "probe result not found"),
])
def test_diagnose_names_the_bad_argument(kwargs, error, message):
    args = {"fn": lambda: None, **kwargs}
    with pytest.raises(error, match=message):
        diagnose(**args, progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_diagnose_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="needs CUDA"):
        diagnose(lambda: None, progress=False)


def test_record_trace_marks_steps_and_boundaries(tmp_path):
    x = torch.randn(16, 16)
    calls = []
    path = record_trace(lambda: calls.append((x @ x).sum()), tmp_path / "t.json.gz", steps=3, warmup=2)
    assert len(calls) == 6  # 2 warm-up, 1 profiled outside the steps, 3 steps
    trace = load_trace(path)
    assert [s.name for s in trace.steps] == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    assert sum(a.name == "fuselab.doctor.step_boundary" for a in trace.annotations) == 3
    mms = [op for op in trace.cpu_ops if op.name == "aten::mm"]
    assert len(mms) == 4 and mms[0].input_dims == [[16, 16], [16, 16]]
    in_steps = [op for op in mms if any(s.ts <= op.ts <= s.end for s in trace.steps)]
    assert len(in_steps) == 3


def test_step_outside_a_profiled_script_does_nothing():
    step()


def test_profile_script_records_marked_steps_then_stops(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(
        "import sys, torch\nfrom fuselab.doctor import step\nx = torch.ones(4)\n"
        "for i in range(6):\n    x = x * 2\n    step()\nassert sys.argv[1:] == ['--flag']\nsys.exit(0)\n"
    )
    path, recorded = profile_script(script, ["--flag"], tmp_path / "t.json", steps=2, warmup=1)
    assert recorded == 3
    trace = load_trace(path)
    assert [s.name for s in trace.steps] == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    assert sum(op.name == "aten::mul" for op in trace.cpu_ops) == 3  # profiling stopped after 3 steps


def test_profile_script_without_markers_is_one_step(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import torch\ntorch.ones(4).add_(1)\n")
    path, recorded = profile_script(script, [], tmp_path / "t.json", steps=2, warmup=1)
    assert recorded == 1 and len(load_trace(path).steps) == 1


def test_flat_batch_test_makes_a_mostly_busy_step_launch_bound(tmp_path):
    # 4 kernels of 30 us with 8 us of host-caused gaps between them: 80% busy, memory-bound by the kernels.
    b = dt.TraceBuilder()
    b.step(0, 0.0, 160.0)
    for k in range(4):
        b.launch("aten::exp", 38.0 * k, 38.0 * k + 8, 30.0, [[1 << 20]], ["float"])
    analysis = analyze_file(b.write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    assert verdict_for(analysis).verdict == "memory-bound"
    flat = verdict_for(analysis, {"factor": 10, "ratio": 1.1})
    assert flat.verdict == "launch-bound" and any("10x the batch took 1.10x" in e for e in flat.evidence)
    assert verdict_for(analysis, {"factor": 10, "ratio": 9.0}).verdict == "memory-bound"


def test_diagnose_judges_the_step_timed_without_the_profiler(tmp_path, monkeypatch):
    # The GPU parts stubbed: the recorded trace is the graph replay, and the step times 210 us unprofiled.
    import fuselab.doctor.profile as profile_module

    timed = []

    def bench(fn, **kwargs):
        timed.append(kwargs)
        return SimpleNamespace(median_us=210.0)

    monkeypatch.setattr(profile_module, "has_cuda", lambda: True)
    monkeypatch.setattr(profile_module, "record_trace", lambda fn, path, **kw: dt.graph_replay().write(path))
    monkeypatch.setattr(profile_module, "bench", bench)
    d = diagnose(lambda: None, ceilings=STATED_CEILINGS, progress=False)
    assert timed == [{"warmup_ms": 10, "rep_ms": profile_module.UNPROFILED_REP_MS, "flush_l2": False}]
    assert d.unprofiled_us_per_step == 210.0 and d.verdict == "memory-bound"
