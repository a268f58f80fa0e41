"""Several streams: busy time per stream, copy/compute overlap, NCCL kernels as communication."""

from pathlib import Path

import pytest

import doctor_traces as dt
import doctor_view_traces as vt
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.streams import overlap_us
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
