"""Time by region: forward / backward / optimizer, the nn.Module tree and record_function ranges."""

from pathlib import Path

import pytest

import doctor_traces as dt
import doctor_view_traces as vt
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.regions import UNATTRIBUTED

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"


def _regions(path):
    return analyze_trace(path, ceilings=STATED_CEILINGS).views.regions


def _by_path(rows):
    return {r.path: r for r in rows}


def test_training_step_splits_into_phases(tmp_path):
    r = _regions(vt.training_step().write(tmp_path / "t.json"))
    phases = _by_path(r.phases)
    assert list(phases) == [("forward",), ("backward",), ("optimizer",)]
    assert [phases[p].gpu_us_per_step for p in phases] == [160.0, 520.0, 150.0]
    assert [phases[p].kernels_per_step for p in phases] == [3, 4, 1]
    assert sum(p.share for p in r.phases) == pytest.approx(1.0)


def test_backward_is_charged_to_the_module_of_its_forward_op(tmp_path):
    modules = _by_path(_regions(vt.training_step().write(tmp_path / "t.json")).modules)
    assert list(modules) == [  # parents before children, in the order they ran
        ("forward", "Net_0"), ("forward", "Net_0", "Linear_0"), ("forward", "Net_0", "Linear_1"),
        ("backward", "Net_0"), ("backward", "Net_0", "Linear_1"), ("backward", "Net_0", "Linear_0"),
    ]
    gpu = {p: m.gpu_us_per_step for p, m in modules.items()}
    assert gpu[("forward", "Net_0")] == 150.0  # the loss (10 us) ran outside the modules
    assert gpu[("forward", "Net_0", "Linear_0")] == 100.0 and gpu[("backward", "Net_0", "Linear_0")] == 400.0
    assert gpu[("backward", "Net_0")] == 500.0  # AccumulateGrad's 20 us has no module
    assert modules[("forward", "Net_0", "Linear_0")].host_us_per_step == 380.0
    assert modules[("backward", "Net_0", "Linear_0")].host_us_per_step is None


def test_record_function_ranges_get_the_work_launched_inside(tmp_path):
    ranges = _by_path(_regions(vt.training_step().write(tmp_path / "t.json")).ranges)
    assert list(ranges) == [("forward",), ("Optimizer.step#AdamW.step",)]  # ProfilerStep ranges are not regions
    assert (ranges[("forward",)].gpu_us_per_step, ranges[("forward",)].host_us_per_step) == (160.0, 1000.0)
    assert ranges[("Optimizer.step#AdamW.step",)].gpu_us_per_step == 150.0


def test_graph_replay_is_charged_where_the_graph_was_launched(tmp_path):
    r = _regions(dt.graph_replay().write(tmp_path / "t.json"))
    assert [(p.path, p.kernels_per_step) for p in r.phases] == [(("forward",), 22)]
    assert r.modules == [] and r.ranges == []


def test_work_without_a_recorded_launch_is_set_apart(tmp_path):
    b = vt.ViewTraceBuilder()
    b.step(0, 0.0, 100.0)
    b._x("kernel", "orphan_kernel", 10.0, 5.0, pid=0, tid=dt.STREAM, device=0, stream=dt.STREAM)  # no launch, no op
    phases = _regions(b.write(tmp_path / "t.json")).phases
    assert [(p.path, p.gpu_us_per_step) for p in phases] == [((UNATTRIBUTED,), 5.0)]


def test_recorded_decode_gives_the_model_tree_per_layer():
    r = _regions(FIXTURES / "llama_decode.json.gz")
    assert [p.path for p in r.phases] == [("forward",)]
    modules = _by_path(r.modules)
    model = ("forward", "LlamaForCausalLM_0", "LlamaModel_0")
    layers = [p for p in modules if len(p) == 4 and p[:3] == model and p[3].startswith("LlamaDecoderLayer_")]
    assert len(layers) >= 2
    for layer in layers:  # a layer's time is mostly its attention's, its MLP's and its norms' (residual adds aside)
        children = [m for p, m in modules.items() if len(p) == 5 and p[:4] == layer]
        assert {c.path[-1].split("_")[0] for c in children} == {"LlamaRMSNorm", "LlamaAttention", "LlamaMLP"}
        inside = sum(c.gpu_us_per_step for c in children)
        assert 0.9 * modules[layer].gpu_us_per_step < inside < modules[layer].gpu_us_per_step
    assert modules[("forward", "LlamaForCausalLM_0")].share > 0.9
