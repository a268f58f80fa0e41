"""The unprofiled step time beside the profiled one, the profiler's overhead stated, and the verdict judged unprofiled."""

import json

import pytest

import doctor_traces as dt
from fuselab.device import STATED_CEILINGS
from fuselab.doctor.analyze import analyze_file
from fuselab.doctor.profile import UNPROFILED_STEPS, record_script
from fuselab.doctor.trace import load_trace
from fuselab.doctor.verdict import verdict_for


def _loop_script(tmp_path, steps: int):
    script = tmp_path / "loop.py"
    script.write_text("import torch\nfrom fuselab.doctor import step\nx = torch.ones(64)\n"
                      f"for i in range({steps}):\n    x = (x * 1.001).sin()\n    step()\n")
    return script


def test_script_steps_after_the_profiled_ones_are_timed(tmp_path):
    run = record_script(_loop_script(tmp_path, 12), [], tmp_path / "t.json", steps=2, warmup=1)
    assert run.recorded == 3
    assert len(run.unprofiled_step_us) == 12 - 3  # from the end of the last profiled step on
    assert all(us > 0 for us in run.unprofiled_step_us) and run.unprofiled_us > 0
    assert sum(op.name == "aten::sin" for op in load_trace(run.trace).cpu_ops) == 3


def test_unprofiled_timing_stops_after_enough_steps(tmp_path):
    run = record_script(_loop_script(tmp_path, UNPROFILED_STEPS + 10), [], tmp_path / "t.json", steps=1, warmup=0)
    assert len(run.unprofiled_step_us) == UNPROFILED_STEPS


def test_script_without_extra_steps_has_no_unprofiled_time(tmp_path):
    run = record_script(_loop_script(tmp_path, 3), [], tmp_path / "t.json", steps=2, warmup=1)
    assert run.unprofiled_step_us == [] and run.unprofiled_us is None


def test_steps_record_the_float32_matmul_precision(tmp_path):
    run = record_script(_loop_script(tmp_path, 3), [], tmp_path / "t.json", steps=2, warmup=1)
    marks = [a.name for a in load_trace(run.trace).annotations if a.name.startswith("fuselab.doctor.float32_matmul_precision=")]
    assert len(marks) == 3 and marks[0].endswith("=highest")


def _slow_host_memory_bound():
    b = dt.TraceBuilder()
    b.step(0, 0.0, 240.0)
    for k in range(4):
        b.launch("aten::exp", 60.0 * k, 60.0 * k + 8, 30.0, [[1 << 20]], ["float"])
    return b


def test_verdict_that_changes_without_the_profiler_says_so(tmp_path):
    analysis = analyze_file(_slow_host_memory_bound().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    d = verdict_for(analysis, unprofiled_us=125.0)
    assert d.verdict == "memory-bound" and d.profiled_verdict == "launch-bound"
    assert any("as profiled the step would read launch-bound; without the profiler it is memory-bound" in e for e in d.evidence)
    out = json.loads(json.dumps(d.to_dict()))
    assert out["profiled_verdict"] == "launch-bound"
    assert out["profiler_slowdown"] == pytest.approx(analysis.steps[0].wall_us / 125.0)


def test_same_verdict_either_way_is_not_repeated(tmp_path):
    analysis = analyze_file(dt.launch_bound().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    d = verdict_for(analysis, unprofiled_us=800.0)
    assert d.profiled_verdict == "launch-bound" == d.verdict
    assert not any("as profiled the step would read" in e for e in d.evidence)
    assert verdict_for(analysis).profiled_verdict is None  # a trace alone is judged as profiled
