"""Idle time read from the GPU's own timeline: a host that runs ahead is not a launch gap."""

import pytest

import doctor_traces as dt
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.idle import LAUNCH_LATENCY_US


def diagnose_built(builder, tmp_path, **kwargs):
    return analyze_trace(builder.write(tmp_path / "trace.json.gz"), ceilings=STATED_CEILINGS, **kwargs)


def test_host_running_ahead_leaves_no_launch_gaps(tmp_path):
    d = diagnose_built(dt.host_ahead_fp32_matmul(), tmp_path, skip_steps=1)
    assert d.verdict == "compute-bound", d.evidence
    for step in d.analysis.steps:
        assert step.wall_us == pytest.approx(2 * 2700.0 + 2.0)  # from the previous step's last matmul to its own last
        assert step.launch_gap_us == 0.0
        assert step.other_idle_us == pytest.approx(2.0)
        assert step.gpu_busy_us == pytest.approx(5400.0)
        assert step.start > step.host_start + 2000  # the window starts where the GPU was free, long after the host
    assert d.gpu_busy_pct == pytest.approx(100 * 5400 / 5402)
    assert any("the host runs ahead and the work waits in the GPU's queue" in e for e in d.evidence)


def test_first_step_waits_only_until_its_launch_returned(tmp_path):
    step = diagnose_built(dt.host_ahead_fp32_matmul(), tmp_path).analysis.steps[0]
    # The first launch call returns at 16 us; with the allowance the GPU waited on it until 36 us, not until 50.
    assert step.launch_gap_us == pytest.approx(16.0 + LAUNCH_LATENCY_US)
    assert step.other_idle_us == pytest.approx(50.0 - 16.0 - LAUNCH_LATENCY_US + 1.0)


def test_other_steps_work_in_the_window_is_busy_not_idle(tmp_path):
    # Two steps whose kernels interleave on two streams: while step 1's kernel runs, step 0's window is busy.
    b = dt.TraceBuilder()
    b.step(0, 0.0, 20.0)
    b.step(1, 20.0, 20.0)
    b.launch("aten::exp", 0.0, 10.0, 100.0, [[1 << 20]], ["float"])
    ext = b.op("aten::neg", 20.0, 8.0, [[1 << 20]], ["float"])
    corr = b.runtime("cudaLaunchKernel", 22.0, 4.0, ext)
    b.events.append({"ph": "X", "cat": "kernel", "name": "neg_kernel", "pid": 0, "tid": 9, "ts": dt.BASE + 30.0, "dur": 150.0,
                     "args": {"External id": ext, "device": 0, "stream": 9, "correlation": corr}})
    d = diagnose_built(b, tmp_path)
    first = d.analysis.steps[0]
    assert first.gpu_busy_us == pytest.approx(100.0)  # 10-110: busy throughout, part of it step 1's kernel
    assert first.launch_gap_us == pytest.approx(10.0) and first.other_idle_us == 0.0


@pytest.mark.parametrize("builder", [dt.launch_bound, dt.sync_bound, dt.memory_bound, dt.compute_bound, dt.graph_replay,
                                     dt.host_ahead_fp32_matmul, dt.host_to_device_copy, dt.adamw_loop, dt.attention])
def test_parts_add_up_to_the_step(tmp_path, builder):
    d = diagnose_built(builder(), tmp_path)
    assert sum(p["share"] for p in d.breakdown.values()) == pytest.approx(1.0)
    for step in d.analysis.steps:
        parts = step.compute_us + step.memory_us + step.copy_us + step.launch_gap_us + step.sync_stall_us + step.other_idle_us
        assert parts == pytest.approx(step.wall_us)
