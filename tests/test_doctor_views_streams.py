"""Several streams: busy time per stream, copy/compute overlap, NCCL kernels as communication."""

from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

import doctor_traces as dt
import doctor_view_traces as vt
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.compare import compare_reports
from fuselab.doctor.html import write_html
from fuselab.doctor.report import render
from fuselab.doctor.streams import overlap_us
from fuselab.doctor.summary import summarize
from fuselab.doctor.views_report import streams_table

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"


def test_busy_time_per_stream_and_overlaps(tmp_path):
    d = analyze_trace(vt.overlapped_streams().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    s = d.views.streams
    assert [(r.stream, r.busy_us, r.kernels, r.copies, r.communication_us) for r in s.rows] == [
        (dt.STREAM, 500.0, 2, 0, 0.0), (vt.COPY_STREAM, 300.0, 0, 1, 0.0), (vt.NCCL_STREAM, 250.0, 1, 0, 250.0)]
    assert [r.share for r in s.rows] == [0.5, 0.3, 0.25]
    assert (s.copy_us, s.copy_compute_overlap_us) == (300.0, 200.0)
    assert (s.communication_us, s.communication_compute_overlap_us) == (250.0, 50.0)
    assert d.to_dict()["streams"]["copy_compute_overlap_us"] == 200.0
    table = streams_table(d.views)
    assert table is not None and "200 us of it under compute" in table.caption and "NCCL" in table.caption


def test_one_stream_has_no_overlap_and_no_table(tmp_path):
    d = analyze_trace(dt.sync_bound().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    s = d.views.streams
    assert len(s.rows) == 1 and s.rows[0].busy_us == pytest.approx(220.0)
    assert s.copy_us == 20.0 and s.copy_compute_overlap_us == 0.0 and s.communication_us == 0.0
    assert streams_table(d.views) is None


@pytest.mark.parametrize("a, b, common", [
    ([(0, 10)], [(5, 20)], 5), ([(0, 10), (20, 30)], [(5, 25)], 10), ([(0, 5)], [(5, 10)], 0), ([], [(0, 1)], 0),
    ([(0, 100)], [(10, 20), (30, 40), (90, 120)], 30),
])
def test_overlap_of_interval_sets(a, b, common):
    assert overlap_us(a, b) == common == overlap_us(b, a)


def test_recorded_trace_is_one_stream():
    d = analyze_trace(FIXTURES / "sync_bound.json.gz", ceilings=STATED_CEILINGS)
    s = d.views.streams
    assert [r.stream for r in s.rows] == [7] and s.copy_compute_overlap_us == 0.0
    assert s.rows[0].busy_us == pytest.approx(d.analysis.steps[0].gpu_busy_us, rel=0.05)


def test_nccl_kernels_are_a_part_of_their_own_in_the_breakdown(tmp_path):
    d = analyze_trace(vt.overlapped_streams().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    comm = d.breakdown["communication"]
    busy = 800.0  # 100..900: compute, copy and all-reduce run back to back or overlapping
    # Overlapping streams share the busy time by their own times: 500 compute, 300 copy, 250 all-reduce.
    assert comm["us"] == pytest.approx(250.0 * busy / 1050.0) and comm["calls"] == 1
    assert comm["share"] == pytest.approx(comm["us"] / d.wall_us_per_step)
    assert sum(p["share"] for p in d.breakdown.values()) == pytest.approx(1.0)
    assert d.breakdown["copies"]["us"] == pytest.approx(300.0 * busy / 1050.0)
    assert d.breakdown["compute"]["us"] + d.breakdown["memory"]["us"] == pytest.approx(500.0 * busy / 1050.0)
    assert [s.communication_kernels for s in d.analysis.steps] == [1, 1]
    assert d.to_dict()["breakdown"]["communication"] == comm
    assert any(line.startswith("communication (NCCL kernels): 1 per step") for line in d.evidence), d.evidence


def test_no_nccl_kernels_no_communication_part(tmp_path):
    d = analyze_trace(dt.sync_bound().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    assert "communication" not in d.breakdown and not any("NCCL" in line for line in d.evidence)
    out = StringIO()
    render(d, Console(file=out, width=200))
    assert "communication (NCCL kernels)" not in out.getvalue()


def test_communication_in_the_text_and_html_reports(tmp_path):
    d = analyze_trace(vt.overlapped_streams().write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    out = StringIO()
    render(d, Console(file=out, width=200))
    row = next(line for line in out.getvalue().splitlines() if "│ communication (NCCL kernels)" in line)
    assert f"{d.breakdown['communication']['us']:.1f}" in row and " 1 " in row
    write_html(d, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "communication (NCCL kernels): " in page and "1 calls per step" in page


def test_compare_shows_communication_and_its_kernels(tmp_path):
    before = analyze_trace(vt.overlapped_streams().write(tmp_path / "a.json"), ceilings=STATED_CEILINGS).to_dict()
    after = analyze_trace(dt.sync_bound().write(tmp_path / "b.json"), ceilings=STATED_CEILINGS).to_dict()
    c = compare_reports(before, after)
    metrics = {m.name: m for m in c.metrics}
    assert metrics["communication (NCCL kernels)"].before == before["breakdown"]["communication"]["us"]
    assert metrics["communication (NCCL kernels)"].after is None
    assert (metrics["NCCL kernels"].before, metrics["NCCL kernels"].after) == (1, None)
    assert metrics["communication under compute"].before == 50.0
    assert vt.NCCL_ALL_REDUCE in c.kernels.gone
    same = compare_reports(after, after)
    assert not {"communication (NCCL kernels)", "NCCL kernels"} & {m.name for m in same.metrics}


def test_nccl_kernels_stay_out_of_the_memory_roofline(tmp_path):
    b = vt.overlapped_streams()
    for e in b.events:  # give the all-reduce's op shapes, as c10d records them, so the roofline could cost it
        if e.get("name") == "c10d::allreduce_":
            e["args"]["Input Dims"], e["args"]["Input type"] = [[[4096, 4096]]], ["TensorList"]
    d = analyze_trace(b.write(tmp_path / "t.json"), ceilings=STATED_CEILINGS)
    nccl = [c for g, c in zip(d.analysis.trace.gpu, d.analysis.costs) if g.name == vt.NCCL_ALL_REDUCE]
    # Costed as a memory-bound in-place op: the case the exclusion is for. The other kernels are
    # compute-bound GEMMs and an uncosted copy, so no memory-bound kernel is left to rate.
    assert nccl and all(c.bound == "memory" and c.pct_of_ceiling is not None for c in nccl)
    assert summarize(d.analysis).memory_pct is None
