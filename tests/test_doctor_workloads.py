"""The doctor on the labelled workloads of scripts/doctor-workloads/, recorded on a GPU both ways.

scripts/record-doctor-workloads writes, per workload, the trace of `fuselab doctor SCRIPT` (with its
diagnosis, which holds the unprofiled step time) and the trace of a plain torch.profiler schedule,
with labels.json saying what the doctor must find. These tests read them from
tests/fixtures/doctor/workloads/ and check verdicts, rules, sync lines and numbers against the
labels; until they are recorded, they skip. The workloads themselves are smoke-tested on the CPU.
"""

import importlib.machinery
import importlib.util
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from fuselab.device import Ceilings, STATED_CEILINGS
from fuselab.doctor.analyze import analyze_file
from fuselab.doctor.trace import load_trace
from fuselab.doctor.verdict import verdict_for

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "doctor" / "workloads"
LABELS = FIXTURES / "labels.json"
WORKLOADS = ROOT / "scripts" / "doctor-workloads"
DRIVER = ROOT / "scripts" / "record-doctor-workloads"
NOT_RECORDED = ("no recorded workloads yet: on a GPU machine run `PYTHONPATH=. python3 scripts/record-doctor-workloads "
                "tests/fixtures/doctor/workloads` and commit what it writes")


def _labels() -> dict:
    return json.loads(LABELS.read_text())["workloads"] if LABELS.is_file() else {}


RECORDED = [(name, mode) for name in _labels() for mode in ("script", "plain")]


def _diagnosis(name: str, mode: str):
    """The workload's diagnosis re-read on this machine, against the ceilings the recording used."""
    label = _labels()[name]
    status = label["status"][mode]
    assert status == "ok", f"{name}: the {mode} recording failed on the GPU: {status}"
    doctor = json.loads((FIXTURES / f"{name}.doctor.json").read_text()) if (FIXTURES / f"{name}.doctor.json").is_file() else None
    ceilings = STATED_CEILINGS
    if doctor is not None:
        c = doctor["ceilings"]
        ceilings = Ceilings(c["copy_bandwidth_gbs"], c["bf16_tflops"], c["source"])
    if mode == "script":
        warmup = json.loads(LABELS.read_text())["doctor"]["warmup"]
        analysis = analyze_file(FIXTURES / f"{name}.script.json.gz", ceilings=ceilings, skip_steps=warmup)
        return verdict_for(analysis, unprofiled_us=doctor["unprofiled_us_per_step"]), doctor
    return verdict_for(analyze_file(FIXTURES / f"{name}.plain.json.gz", ceilings=ceilings)), doctor


@pytest.mark.skipif(not RECORDED, reason=NOT_RECORDED)
@pytest.mark.parametrize("name, mode", RECORDED, ids=[f"{n}-{m}" for n, m in RECORDED])
def test_workload_gets_what_its_label_says(name, mode):
    label = _labels()[name]
    d, doctor = _diagnosis(name, mode)
    if mode == "script":
        assert d.verdict == doctor["verdict"]  # the analysis here agrees with the run on the GPU
        assert doctor["unprofiled_us_per_step"], "the script ran steps past the profiled ones: they must be timed"
    want = label.get("verdict") if mode == "script" else label.get("plain_verdict")
    if want:
        assert d.verdict == want, d.evidence
    if mode == "script" and label.get("profiled_verdict"):
        assert (d.profiled_verdict or d.verdict) == label["profiled_verdict"], d.evidence
    rules = {f.rule for f in d.fixes}
    assert set(label.get("rules", [])) <= rules, [f.to_dict() for f in d.fixes]
    assert not set(label.get("not_rules", [])) & rules, [f.to_dict() for f in d.fixes]
    for key in ("syncs_per_step", "kernels_per_step"):
        if key in label:
            assert getattr(d, key) == label[key]


@pytest.mark.skipif(not RECORDED, reason=NOT_RECORDED)
@pytest.mark.parametrize("name, mode", RECORDED, ids=[f"{n}-{m}" for n, m in RECORDED])
def test_workload_sync_lines(name, mode):
    label = _labels()[name]
    d, _ = _diagnosis(name, mode)
    script = Path(label["script"]).name
    syncs = [s for step in d.analysis.syncs for s in step]
    if mode == "plain":
        assert not any(s.source_exact for s in syncs)  # a plain trace has only the profiler's lines
        return
    exact = {int(s.source.split(" (")[0].rsplit(":", 1)[1]) for s in syncs if s.source_exact}
    assert all(s.source.split(" (")[0].rsplit(":", 1)[0].endswith(script) for s in syncs if s.source_exact)
    assert exact == set(label["sync_lines"]), [s.to_dict() for s in syncs]


@pytest.mark.skipif(not RECORDED, reason=NOT_RECORDED)
@pytest.mark.parametrize("name, mode", RECORDED, ids=[f"{n}-{m}" for n, m in RECORDED])
def test_workload_numbers(name, mode):
    label = _labels()[name]
    d, _ = _diagnosis(name, mode)
    assert sum(p["share"] for p in d.breakdown.values()) == pytest.approx(1.0)
    assert sum(f.saving_us for f in d.fixes) <= sum(p["us"] for p in d.breakdown.values()) * (1 + 1e-9)
    chains = [c.labels for c in d.analysis.fusion]
    for i, a in enumerate(chains):  # each chain reported once: no rotation of one among the others
        assert not [b for b in chains[i + 1:] if len(a) == len(b) and " ".join(b) in " ".join(a + a)], chains
    if "precision" in label:
        compute_gemms = {c.precision for c in d.analysis.costs if c.precision and c.bound == "compute"}
        assert compute_gemms == {label["precision"]}
    if "copy" in label:
        top = d.analysis.copies[0]
        want = label["copy"]
        assert (top.direction, top.src) == (want["direction"], want["src"])
        assert top.bytes == pytest.approx(want["bytes"], rel=0.01)
    if "optimizer" in label:
        assert label["optimizer"] in {c.optimizer for c in d.analysis.fusion if c.rule == "optimizer"}
    if "max_launch_gap_share" in label:
        assert d.breakdown["launch_gaps"]["share"] <= label["max_launch_gap_share"], d.evidence
    streams = d.views.streams
    if "streams" in label:
        assert len(streams.rows) >= label["streams"], [r.to_dict() for r in streams.rows]
    if "copy_under_compute" in label:
        assert streams.copy_us > 0 and streams.copy_compute_overlap_us >= label["copy_under_compute"] * streams.copy_us
    for part in label.get("parts", []):
        assert d.breakdown.get(part, {}).get("us", 0.0) > 0, d.breakdown
    phases = {r.path[0]: r.gpu_us_per_step for r in d.views.regions.phases}
    for phase in label.get("regions", []):
        assert phases.get(phase, 0.0) > 0, phases


def _driver():
    loader = importlib.machinery.SourceFileLoader("record_doctor_workloads", str(DRIVER))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_driver_help(capsys):
    with pytest.raises(SystemExit) as exc:
        _driver().main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "OUTDIR" in out and "labels.json" in out and "--only" in out


def test_every_workload_has_a_label():
    driver = _driver()
    for path in driver.workload_paths(None):
        label = driver.label(path)
        assert label.get("rules") or label.get("not_rules") or label.get("verdict"), path.name
        if "sync" in label.get("rules", []) or "blocking-copy" in label.get("rules", []):
            assert label["sync_lines"], f"{path.name}: mark the line of its sync with '# doctor-label: sync'"


def _every_rule_fires_somewhere_and_not_elsewhere():
    driver = _driver()
    labels = [driver.label(p) for p in driver.workload_paths(None)]
    fires = {r for label in labels for r in label.get("rules", [])}
    quiet = {r for label in labels for r in label.get("not_rules", [])}
    return fires, quiet


def test_each_rule_has_a_workload_where_it_fires_and_one_where_it_must_not():
    fires, quiet = _every_rule_fires_somewhere_and_not_elsewhere()
    for rule in ("sync", "blocking-copy", "pageable-copy", "tf32", "bf16", "optimizer", "kernel:rms_norm", "attention",
                 "launch-gaps"):
        assert rule in fires and rule in quiet, rule


WORKLOAD_FILES = sorted(p for p in WORKLOADS.glob("*.py") if not p.name.startswith("_"))


@pytest.fixture
def workload_process():
    """Run a workload in this process as its own __main__, and undo what it changes."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    precision = torch.get_float32_matmul_precision()
    sys.path.insert(0, str(WORKLOADS))
    yield
    sys.argv, sys.path[:] = saved_argv, saved_path
    torch.set_float32_matmul_precision(precision)


@pytest.mark.parametrize("path", WORKLOAD_FILES, ids=[p.stem for p in WORKLOAD_FILES])
def test_workload_runs_two_steps_on_this_machine(path, workload_process):
    if "require_gpu(" in path.read_text() and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (pinned host memory)")
    sys.argv = [str(path), "--steps", "2"]
    runpy.run_path(str(path), run_name="__main__")


def test_workload_records_a_plain_profiler_schedule(tmp_path, workload_process):
    path = WORKLOADS / "launch_bound_small_ops.py"
    sys.argv = [str(path), "--steps", "6", "--profiler-trace", str(tmp_path / "plain.json.gz")]
    runpy.run_path(str(path), run_name="__main__")
    trace = load_trace(tmp_path / "plain.json.gz")
    assert [s.name for s in trace.steps] == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]  # wait 1, warmup 1, active 3
    assert not [a for a in trace.annotations if a.name == "fuselab.doctor.step_boundary"]  # no sync at step ends


def _recorded(name: str) -> bool:
    return name in _labels() and all((FIXTURES / f"{name}.{mode}.json.gz").is_file() for mode in ("script", "plain"))


@pytest.mark.parametrize("mode", ["script", "plain"])
def test_tf32_only_where_float32_gemms_are_limited_by_their_math(mode):
    if not (_recorded("adamw_fused") and _recorded("host_ahead_fp32_matmul")):
        pytest.skip(NOT_RECORDED)
    small, _ = _diagnosis("adamw_fused", mode)  # 64 x 512 x 512 float32 GEMMs, at 8-20% of the float32 rate
    assert any(c.precision == "fp32" and c.bound == "compute" for c in small.analysis.costs)
    assert "tf32" not in {f.rule for f in small.fixes}
    large, _ = _diagnosis("host_ahead_fp32_matmul", mode)  # 8192^2 float32 GEMMs at the float32 rate
    assert "tf32" in {f.rule for f in large.fixes}


@pytest.mark.skipif(not RECORDED, reason=NOT_RECORDED)
@pytest.mark.parametrize("name, mode", RECORDED, ids=[f"{n}-{m}" for n, m in RECORDED])
def test_each_fix_is_listed_once(name, mode):
    d, _ = _diagnosis(name, mode)
    actions = [f.action for f in d.fixes]
    assert len(actions) == len(set(actions)), actions
    assert [f.rule for f in d.fixes].count("optimizer") <= 1, actions  # one optimizer, one fused-optimizer fix


# The workloads for several streams, a training step's phases and NCCL: each checked for what it is there
# to show, beside the generic label checks above. They skip until recorded on a GPU.


def _both_modes(name: str):
    if not _recorded(name):
        pytest.skip(f"{name} is not recorded yet: on a GPU machine run `PYTHONPATH=. python3 "
                    f"scripts/record-doctor-workloads tests/fixtures/doctor/workloads --only {name}`")
    return [_diagnosis(name, mode)[0] for mode in ("script", "plain")]


def test_two_streams_overlap_hides_the_copy_under_compute():
    script, plain = _both_modes("two_streams_overlap")
    assert script.verdict == "compute-bound", script.evidence
    for d in (script, plain):
        s = d.views.streams
        assert len({(r.device, r.stream) for r in s.rows}) >= 2
        assert s.copy_us > 0 and s.copy_compute_overlap_us >= 0.2 * s.copy_us, s.to_dict()
        rules = {f.rule for f in d.fixes}
        assert not rules & {"pageable-copy", "blocking-copy", "sync"}, rules


def test_train_backward_has_its_three_phases():
    for d in _both_modes("train_backward"):
        phases = {r.path[0]: r for r in d.views.regions.phases}
        for phase in ("forward", "backward", "optimizer"):
            assert phase in phases and phases[phase].gpu_us_per_step > 0, list(phases)
            assert phases[phase].kernels_per_step >= 1
