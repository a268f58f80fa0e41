"""The analysis on synthetic traces laid out by hand: exact kernel counts, gap splits, syncs, roofline, verdicts."""

import pytest

import doctor_traces as dt
from fuselab.device import Ceilings, STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.analyze import analyze_file
from fuselab.doctor.roofline import op_cost
from fuselab.doctor.trace import CpuOp
from fuselab.doctor.fixes import OUTSIDE_GRAPH_FIX, REPLAY_HOST_FIX
from fuselab.doctor.verdict import verdict_for


def diagnose_built(builder, tmp_path, ceilings=STATED_CEILINGS, **kwargs):
    return analyze_trace(builder.write(tmp_path / "trace.json.gz"), ceilings=ceilings, **kwargs)


def test_launch_bound_numbers(tmp_path):
    d = diagnose_built(dt.launch_bound(), tmp_path)
    assert d.verdict == "launch-bound"
    assert d.steps == 3 and d.kernels_per_step == 98 and d.syncs_per_step == 0
    assert d.gpu_busy_pct == pytest.approx(19.6)
    b = d.breakdown
    assert b["launch_gaps"]["us"] == pytest.approx(804.0)
    assert b["sync_stalls"]["us"] == 0 and b["other_idle"]["us"] == 0
    assert b["compute"]["us"] + b["memory"]["us"] == pytest.approx(196.0)
    step = d.analysis.steps[0]
    assert step.median_kernel_us == 2.0 and step.launches == 98
    assert step.launches_per_s == pytest.approx(98_000)
    assert step.launch_delay_us == {"median": 5.0, "p90": 5.0, "max": 5.0}
    assert "graphed" in d.fixes[0].action


def test_unfused_rms_norm_is_found_with_its_fix(tmp_path):
    d = diagnose_built(dt.launch_bound(), tmp_path)
    top = d.analysis.fusion[0]
    assert top.labels == ("pow", "mean", "add", "rsqrt", "mul", "mul")
    assert top.count == 14 * 3
    assert top.kernels_us == pytest.approx(14 * 3 * 6 * 2.0)
    assert top.total_us == pytest.approx(14 * 3 * 52.0)  # first start to last end: 5 x 10 us + 2 us
    assert "fuselab.kernels.rms_norm" in top.fix
    assert any("rms_norm" in f.action for f in d.fixes)


def test_sync_bound_numbers_and_source_line(tmp_path):
    d = diagnose_built(dt.sync_bound(), tmp_path)
    assert d.verdict == "sync-bound"
    assert d.kernels_per_step == 10 and d.syncs_per_step == 10
    assert d.breakdown["sync_stalls"]["us"] == pytest.approx(775.0)
    assert d.breakdown["launch_gaps"]["us"] == pytest.approx(5.0)
    assert d.gpu_busy_pct == pytest.approx(22.0)
    syncs = d.analysis.syncs[0]
    assert len(syncs) == 10
    assert {s.cause for s in syncs} == {"`.item()`"}
    assert {s.source for s in syncs} == {"train.py:42 (loop)"}
    assert syncs[0].blocked_us == pytest.approx(19.0)  # 17 us copy + 2 us stream sync
    assert syncs[0].api == "cudaMemcpyAsync+cudaStreamSynchronize"
    assert "train.py:42" in d.fixes[0].action and d.fixes[0].saving_us == pytest.approx(775.0)


def test_memory_bound_numbers(tmp_path):
    d = diagnose_built(dt.memory_bound(), tmp_path)
    assert d.verdict == "memory-bound"
    assert d.wall_us_per_step == pytest.approx(128.0)
    assert d.breakdown["memory"]["us"] == pytest.approx(120.0)
    assert d.breakdown["launch_gaps"]["us"] == pytest.approx(5.0)
    assert d.breakdown["other_idle"]["us"] == pytest.approx(3.0)  # queued long before: not the host's fault
    cost = d.analysis.costs[0]
    assert cost.bytes == 3 * 16_777_216 * 2 and cost.bound == "memory"
    assert cost.pct_of_ceiling == pytest.approx(100 * (3 * 16_777_216 * 2 / 4230e3) / 30.0)
    assert d.analysis.fusion[0].labels == ("mul",) * 4
    assert "one fused kernel" in d.analysis.fusion[0].fix  # large kernels: graph capture would not help


def test_compute_bound_numbers(tmp_path):
    d = diagnose_built(dt.compute_bound(), tmp_path)
    assert d.verdict == "compute-bound"
    cost = d.analysis.costs[0]
    assert cost.flops == 2.0 * 8192**3 and cost.bound == "compute"
    assert cost.pct_of_ceiling == pytest.approx(100 * (2 * 8192**3 / 780e6) / 1800.0)
    assert d.fixes[0].action.startswith("nothing to gain from fusion")


def test_measured_ceilings_move_the_ridge(tmp_path):
    # With a matmul unit 1000x faster, the ridge moves past the GEMM's intensity: it becomes memory-bound.
    fast_compute = Ceilings(copy_bandwidth_gbs=4230.0, bf16_tflops=780_000.0, source="test")
    d = diagnose_built(dt.compute_bound(), tmp_path, ceilings=fast_compute)
    assert d.analysis.costs[0].bound == "memory" and d.verdict == "memory-bound"


def test_skip_steps_drops_warmup(tmp_path):
    d = analyze_trace(dt.launch_bound(steps=4).write(tmp_path / "t.json"), ceilings=STATED_CEILINGS, skip_steps=1)
    assert [s.name for s in d.analysis.steps] == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]


def test_trace_without_steps_is_one_step(tmp_path):
    b = dt.memory_bound(steps=1)
    b.events = [e for e in b.events if not e.get("name", "").startswith("ProfilerStep")]
    d = diagnose_built(b, tmp_path)
    assert d.steps == 1 and d.analysis.steps[0].name == "whole trace" and d.kernels_per_step == 4


def _one_sync(tmp_path, ops, frames=(), api="cudaStreamSynchronize", boundary=False):
    """A step with one kernel, then `api` called inside the given ops/frames (outermost first)."""
    b = dt.TraceBuilder()
    b.step(0, 0.0, 200.0)
    b.launch("aten::add", 0.0, 10.0, 5.0, [[4], [4]], ["float", "float"])
    for i, name in enumerate(frames):
        b.frame(name, 20.0 + i, 60.0 - 2 * i)
    ext = None
    for i, name in enumerate(ops):
        ext = b.op(name, 30.0 + i, 40.0 - 2 * i, [[4]], ["float"])
    if boundary:
        b.annotation("fuselab.doctor.step_boundary", 35.0, 30.0)
    if api == "copy":
        corr = b.runtime("cudaMemcpyAsync", 40.0, 10.0, ext)
        b.gpu("Memcpy DtoH (Device -> Pageable)", 45.0, 2.0, corr, ext, cat="gpu_memcpy")
    else:
        b.runtime(api, 40.0, 10.0, ext)
    return diagnose_built(b, tmp_path).analysis.syncs[0]


@pytest.mark.parametrize("ops, frames, api, cause", [
    (["aten::is_nonzero", "aten::item", "aten::_local_scalar_dense"], [], "copy", "`if tensor:`"),
    (["aten::to", "aten::_to_copy", "aten::copy_"], [], "copy", "`.cpu()`"),
    (["aten::nonzero"], [], "cudaStreamSynchronize", "`torch.nonzero`"),
    (["aten::item", "aten::_local_scalar_dense"],
     ["/usr/lib/python3/site-packages/torch/_tensor.py(570): __repr__", "/usr/lib/python3/site-packages/torch/_tensor_str.py(700): _str"],
     "copy", "printing or formatting"),
    ([], [], "cudaDeviceSynchronize", "`torch.cuda.synchronize()`"),
    ([], [], "cudaEventSynchronize", "`event.synchronize()`"),
])
def test_implicit_syncs_are_named(tmp_path, ops, frames, api, cause):
    syncs = _one_sync(tmp_path, ops, frames, api)
    assert len(syncs) == 1 and syncs[0].cause.startswith(cause)


def test_source_line_prefers_user_code_over_libraries(tmp_path):
    frames = ["serve.py(7): main", "/opt/venv/lib/python3.12/site-packages/transformers/generation/utils.py(2500): _sample",
              "/opt/venv/lib/python3.12/site-packages/torch/_tensor.py(40): wrapped"]
    (sync,) = _one_sync(tmp_path, ["aten::item", "aten::_local_scalar_dense"], frames, "copy")
    assert sync.source == "serve.py:7 (main)"


def test_pinned_async_copy_is_not_a_sync(tmp_path):
    b = dt.TraceBuilder()
    b.step(0, 0.0, 100.0)
    b.launch("aten::add", 0.0, 10.0, 5.0, [[4], [4]], ["float", "float"])
    ext = b.op("aten::copy_", 20.0, 10.0, [[4], [4]], ["float", "float"])
    b.gpu("Memcpy DtoH (Device -> Pinned)", 25.0, 2.0, b.runtime("cudaMemcpyAsync", 21.0, 3.0, ext), ext, cat="gpu_memcpy")
    d = diagnose_built(b, tmp_path)
    assert d.syncs_per_step == 0


def test_step_boundary_sync_is_not_the_workloads(tmp_path):
    assert _one_sync(tmp_path, [], [], "cudaDeviceSynchronize", boundary=True) == []


@pytest.mark.parametrize("name, dims, types, flops, nbytes", [
    ("aten::mm", [[64, 32], [32, 16]], ["float", "float"], 2 * 64 * 32 * 16, 4 * (64 * 32 + 32 * 16 + 64 * 16)),
    ("aten::addmm", [[16], [64, 32], [32, 16], [], []], ["c10::BFloat16"] * 3 + ["Scalar"] * 2,
     2 * 64 * 32 * 16, 2 * (16 + 64 * 32 + 32 * 16 + 64 * 16)),
    ("aten::bmm", [[4, 8, 32], [4, 32, 16]], ["c10::Half"] * 2, 2 * 4 * 8 * 32 * 16, 2 * (4 * 8 * 32 + 4 * 32 * 16 + 4 * 8 * 16)),
    ("aten::linear", [[2, 5, 32], [16, 32], [16]], ["float"] * 3, 2 * 10 * 32 * 16, 4 * (320 + 512 + 16 + 160)),
    ("aten::matmul", [[3, 8, 32], [32, 16]], ["float"] * 2, 2 * 3 * 8 * 32 * 16, 4 * (768 + 512 + 384)),
    ("aten::scaled_dot_product_attention", [[1, 2, 8, 16], [1, 2, 32, 16], [1, 2, 32, 16]], ["c10::BFloat16"] * 3,
     2 * 2 * 8 * 32 * 32, 2 * (256 + 1024 + 1024 + 256)),
    ("aten::add", [[1024, 1], [1024, 64], []], ["float", "float", "Scalar"], 65536, 4 * (1024 + 65536 + 65536)),
    ("aten::mul_", [[100], []], ["float", "Scalar"], 100, 800),
    ("aten::mean", [[10, 100], [], [], []], ["c10::BFloat16", "ScalarList", "Scalar", ""], 1000, 2000),
    ("aten::cat", [[[2, 3], [4, 3]], []], ["TensorList", "Scalar"], 0, 2 * 4 * 18),
])
def test_op_costs_from_shapes(name, dims, types, flops, nbytes):
    cost = op_cost(CpuOp(name, 0.0, 1.0, 0, 1, dims, types))
    assert (cost.flops, cost.bytes) == (flops, nbytes)


def test_to_dict_has_the_promised_keys(tmp_path):
    out = diagnose_built(dt.sync_bound(), tmp_path).to_dict()
    for key in ("verdict", "steps", "kernels_per_step", "syncs_per_step", "gpu_busy_pct", "breakdown", "fixes",
                "per_step", "syncs", "fusion_candidates", "ceilings"):
        assert key in out
    assert set(out["breakdown"]) == {"compute", "memory", "copies", "launch_gaps", "sync_stalls", "other_idle"}
    assert sum(p["share"] for p in out["breakdown"].values()) == pytest.approx(1.0)
    assert out["syncs"][0]["source"] == "train.py:42 (loop)"


def test_gap_is_the_hosts_when_the_launch_was_still_in_progress(tmp_path):
    # Kernel A runs 10-12. B's launch call runs 11-15 (begun before A ended, still in progress when
    # the GPU went idle): the 12-18 gap waited for the host. C was queued at 2-3, long before B
    # ended at 20, so the 20-21 gap before it is not the host's.
    b = dt.TraceBuilder()
    b.step(0, 0.0, 30.0)
    for name, call_ts, kernel_ts in (("aten::neg", 0.0, 10.0), ("aten::exp", 11.0, 18.0), ("aten::abs", 2.0, 21.0)):
        ext = b.op(name, call_ts, 4.0, [[4]], ["float"])
        b.gpu(f"{name}_kernel", kernel_ts, 2.0, b.runtime("cudaLaunchKernel", call_ts, 4.0 if name == "aten::exp" else 1.0, ext), ext)
    step = diagnose_built(b, tmp_path).analysis.steps[0]
    assert step.launch_gap_us == pytest.approx(10.0 + 6.0 + 7.0)  # before A (0-10), A to B, after C (23-30)
    assert step.other_idle_us == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"skip_steps": -1}, ValueError, "skip_steps must be"),
    ({"ceilings": {"bf16_tflops": 1}}, TypeError, "ceilings must be a fuselab.device.Ceilings"),
    ({"ceilings": STATED_CEILINGS, "probe": "probe.json"}, ValueError, "either ceilings or probe"),
])
def test_analyze_trace_names_the_bad_argument(tmp_path, kwargs, error, message):
    path = dt.memory_bound(steps=1).write(tmp_path / "t.json")
    with pytest.raises(error, match=message):
        analyze_trace(path, **kwargs)


def _without_graph_launch_calls(b):
    """The replay as a version that records only the kernels' graph node ids: no cudaGraphLaunch call."""
    b.events = [e for e in b.events if not str(e.get("name", "")).startswith("cudaGraphLaunch")]
    return b


@pytest.mark.parametrize("builder", [
    dt.graph_replay,
    lambda: dt.graph_replay(launch_name="cudaGraphLaunch_v10000"),
    lambda: _without_graph_launch_calls(dt.graph_replay()),
], ids=["graph launch", "versioned graph launch", "graph node ids only"])
def test_graph_replay_has_no_launch_gaps_inside_it(tmp_path, builder):
    d = diagnose_built(builder(), tmp_path)
    step = d.analysis.steps[0]
    assert step.kernels == 22 and step.graph_kernels == 20 and step.graph_launches == 1
    assert step.gpu_busy_us == pytest.approx(204.0)
    assert step.launch_gap_us == pytest.approx(7.0 + 121.0 + 82.0 + 91.0)
    assert step.graph_launch_gap_us == pytest.approx(121.0)  # waiting for the replay to begin
    assert step.other_idle_us == pytest.approx(19 * 5.0)  # between kernels of the replay: GPU-side
    replay = (step.start + 130.0, step.start + 425.0)
    assert not [g for g in d.analysis.gaps[0] if g[2] == "launch" and replay[0] < g[0] < replay[1]]


def test_graph_replay_counts_and_launch_delay(tmp_path):
    d = diagnose_built(dt.graph_replay(), tmp_path)
    step = d.analysis.steps[0]
    assert step.launch_delay_us["median"] == 5.0  # the two copies launched alone, not the replay's kernels
    assert step.median_launched_kernel_us == 2.0
    out = d.to_dict()
    assert out["graph_launches_per_step"] == 1 and out["graph_kernels_per_step"] == 20
    assert out["per_step"][0]["graph_launches"] == 1 and out["per_step"][0]["graph_kernels"] == 20
    assert any(e.startswith("20 kernels per step replayed from 1 graph launch ") for e in d.evidence)


def test_graph_replay_is_not_offered_graph_capture_or_fusion(tmp_path):
    d = diagnose_built(dt.graph_replay(), tmp_path)
    assert d.analysis.fusion == []  # the replayed kernels form no sequence, whatever their names
    assert not [f for f in d.fixes if f.action.startswith("capture the step in a CUDA graph")]
    actions = {f.action: f.saving_us for f in d.fixes}
    assert actions[REPLAY_HOST_FIX] == pytest.approx(121.0)
    assert actions[OUTSIDE_GRAPH_FIX] == pytest.approx(7.0 + 82.0 + 91.0)  # the copies launched alone


def _slow_host_memory_bound():
    """4 kernels of 30 us (1M-element exp), launched 60 us apart: profiled, half the step waits for the host."""
    b = dt.TraceBuilder()
    b.step(0, 0.0, 240.0)
    for k in range(4):
        b.launch("aten::exp", 60.0 * k, 60.0 * k + 8, 30.0, [[1 << 20]], ["float"])
    return b


@pytest.mark.parametrize("builder, unprofiled_us", [(dt.graph_replay, 210.0), (_slow_host_memory_bound, 125.0)],
                         ids=["graph replay", "eager"])
def test_step_busy_without_the_profiler_is_memory_bound(tmp_path, builder, unprofiled_us):
    analysis = analyze_file(builder().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    assert verdict_for(analysis).verdict == "launch-bound"  # as profiled
    d = verdict_for(analysis, unprofiled_us=unprofiled_us)
    busy = analysis.steps[0].gpu_busy_us
    assert d.verdict == "memory-bound", d.evidence
    assert d.gpu_busy_pct == pytest.approx(100 * busy / unprofiled_us)
    assert d.breakdown["memory"]["us"] == pytest.approx(busy)
    assert sum(p["share"] for p in d.breakdown.values()) == pytest.approx(1.0)
    assert sum(d.breakdown[p]["us"] for p in ("launch_gaps", "sync_stalls", "other_idle")) == pytest.approx(unprofiled_us - busy)
    slowed = analysis.steps[0].wall_us / unprofiled_us
    assert f"unprofiled, a step takes {unprofiled_us:.0f} us (the profiler slowed the host {slowed:.1f}x)" in " ".join(d.evidence)
    # Graph capture can remove no more than the few us the unprofiled step idles.
    assert all(f.saving_us <= unprofiled_us - busy + 1e-9 for f in d.fixes if "CUDA graph" in f.action)
    assert d.to_dict()["unprofiled_us_per_step"] == unprofiled_us and d.wall_us_per_step == analysis.steps[0].wall_us


def test_launch_bound_step_stays_launch_bound_without_the_profiler(tmp_path):
    analysis = analyze_file(dt.launch_bound().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    d = verdict_for(analysis, unprofiled_us=800.0)
    assert d.verdict == "launch-bound"
    assert d.gpu_busy_pct == pytest.approx(100 * 196 / 800)
    assert d.breakdown["launch_gaps"]["us"] == pytest.approx(800.0 - 196.0)
    # Graph capture can remove the idle of the unprofiled step, not the profiled 804 us.
    assert "graphed" in d.fixes[0].action and d.fixes[0].saving_us == pytest.approx(604.0)


def test_gpu_busy_is_capped_at_the_whole_step(tmp_path):
    analysis = analyze_file(dt.graph_replay().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    d = verdict_for(analysis, unprofiled_us=150.0)  # less than the 204 us of kernel time the profiler saw
    assert d.gpu_busy_pct == 100.0 and d.breakdown["launch_gaps"]["us"] == 0.0


@pytest.mark.parametrize("value", [0.0, -5.0, "283"])
def test_unprofiled_time_must_be_positive(tmp_path, value):
    analysis = analyze_file(dt.memory_bound().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    with pytest.raises(ValueError, match="unprofiled_us must be"):
        verdict_for(analysis, unprofiled_us=value)
