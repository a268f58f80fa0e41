"""Copies as their own part of a step, and the pageable-copy and blocking-copy rules."""

import pytest

import doctor_traces as dt
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.copies import PINNED_COPY_GBS, copy_route
from fuselab.doctor.syncs import BLOCKING_COPY_TO_GPU


def diagnose_built(builder, tmp_path):
    return analyze_trace(builder.write(tmp_path / "trace.json.gz"), ceilings=STATED_CEILINGS)


@pytest.mark.parametrize("name, route", [
    ("Memcpy HtoD (Pageable -> Device)", ("HtoD", "Pageable", "Device")),
    ("Memcpy DtoH (Device -> Pinned)", ("DtoH", "Device", "Pinned")),
    ("Memcpy DtoD (Device -> Device)", ("DtoD", "Device", "Device")),
])
def test_copy_route_from_kineto_name(name, route):
    r = copy_route(name)
    assert (r.direction, r.src, r.dst) == route and r.pageable == ("Pageable" in route)


def test_copy_route_of_other_events_is_none():
    assert copy_route("Memset (Device)") is None and copy_route("void at::native::mul_kernel") is None


def test_pageable_copy_is_copy_bound_with_the_pinning_fix(tmp_path):
    d = diagnose_built(dt.host_to_device_copy(), tmp_path)
    assert d.verdict == "copy-bound", d.evidence
    assert d.breakdown["copies"]["us"] == pytest.approx(40_000.0)
    assert d.breakdown["memory"]["us"] == pytest.approx(130.0)
    (group,) = d.analysis.copies
    assert (group.direction, group.src, group.dst) == ("HtoD", "Pageable", "Device")
    assert group.count == 1 and group.bytes == dt.COPY_BYTES and group.blocking == 1
    assert group.gbs == pytest.approx(dt.COPY_BYTES / 40_000 / 1e3)
    fix = d.fixes[0]
    assert fix.rule == "pageable-copy" and "pin_memory()" in fix.action and "non_blocking=True" in fix.action
    assert fix.saving_us == pytest.approx(40_000.0 - dt.COPY_BYTES / (PINNED_COPY_GBS * 1e3))
    assert not [f for f in d.fixes if "CUDA graph" in f.action]
    assert any(e.startswith("copies per step (100% of the step): HtoD (Pageable -> Device) 1x 268.4 MB") for e in d.evidence)


def test_blocking_copy_to_the_gpu_is_named(tmp_path):
    syncs = diagnose_built(dt.host_to_device_copy(), tmp_path).analysis.syncs[0]
    assert [s.cause for s in syncs] == [BLOCKING_COPY_TO_GPU]


def test_pinned_non_blocking_copy_fires_no_copy_rule(tmp_path):
    d = diagnose_built(dt.host_to_device_copy(pinned=True), tmp_path)
    (group,) = d.analysis.copies
    assert group.src == "Pinned" and group.blocking == 0
    assert d.syncs_per_step == 0
    assert not {f.rule for f in d.fixes} & {"pageable-copy", "blocking-copy"}


def test_blocking_copy_rule_fires_on_a_sync_behind_a_copy(tmp_path):
    # A 500 us kernel, then a pinned copy made with non_blocking=False: the op waits on the stream, draining the kernel.
    b = dt.TraceBuilder()
    b.step(0, 0.0, 1000.0)
    b.launch("aten::exp", 0.0, 10.0, 500.0, [[1 << 24]], ["float"])
    b.op("aten::to", 20.0, 500.0, [[1024]], ["float"])
    ext = b.op("aten::copy_", 21.0, 498.0, [[1024], [1024]], ["float", "float"])
    b.gpu("Memcpy HtoD (Pinned -> Device)", 510.0, 2.0, b.runtime("cudaMemcpyAsync", 22.0, 3.0, ext), ext, cat="gpu_memcpy", bytes=4096)
    b.runtime("cudaStreamSynchronize", 26.0, 487.0, ext)
    b.launch("aten::neg", 520.0, 600.0, 390.0, [[1 << 24]], ["float"])
    d = diagnose_built(b, tmp_path)
    assert [s.cause for s in d.analysis.syncs[0]] == [BLOCKING_COPY_TO_GPU]
    (fix,) = [f for f in d.fixes if f.rule == "blocking-copy"]
    assert "non_blocking=True" in fix.action and fix.saving_us == pytest.approx(d.breakdown["sync_stalls"]["us"])
    assert d.analysis.copies[0].blocking == 1


def test_small_pageable_copies_are_the_syncs_not_the_copies(tmp_path):
    d = diagnose_built(dt.sync_bound(), tmp_path)  # ten 2 us `.item()` copies to pageable memory per step
    assert d.analysis.copies[0].src == "Device" and d.analysis.copies[0].dst == "Pageable"
    assert "pageable-copy" not in {f.rule for f in d.fixes}
