"""The top-kernels table: calls, time and share per step, achieved rate against its ceiling, grid against the SMs."""

from pathlib import Path

import pytest

import doctor_view_traces as vt
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.views_report import achieved_text, grid_text

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"


def _kernels(path):
    d = analyze_trace(path, ceilings=STATED_CEILINGS)
    return d, {k.name: k for k in d.views.kernels}


def test_rows_give_calls_time_share_and_rate_per_step(tmp_path):
    d, rows = _kernels(vt.kernel_mix().write(tmp_path / "t.json"))
    assert [k.name for k in d.views.kernels] == [vt.GEMM, vt.GEMV, vt.TRITON]  # most time first
    gemm, gemv, triton = rows[vt.GEMM], rows[vt.GEMV], rows[vt.TRITON]
    assert (gemm.calls_per_step, gemm.us_per_step, gemm.share) == (2, 500.0, pytest.approx(0.25))
    assert gemm.bound == "compute" and gemm.unit == "TFLOP/s"
    assert gemm.achieved == pytest.approx(2 * 4096**3 / 250e6)  # 549.8 TFLOP/s
    assert gemm.ceiling == pytest.approx(780.0) and gemm.pct_of_ceiling == pytest.approx(70.48, abs=0.01)
    assert (gemv.calls_per_step, gemv.us_per_step, gemv.op) == (4, 40.0, "aten::mm")
    assert gemv.bound == "memory" and gemv.unit == "GB/s"
    assert gemv.achieved == pytest.approx(33_570_816 / 10e3) and gemv.ceiling == pytest.approx(4230.0)
    assert achieved_text(gemv) == "3,357.1 GB/s (79% of 4,230)"
    # No launching op, so no FLOPs or bytes: the rate is left blank rather than guessed.
    assert triton.op is None and triton.achieved is None and achieved_text(triton) == ""


def test_grids_under_the_sm_count_are_flagged(tmp_path):
    _, rows = _kernels(vt.kernel_mix().write(tmp_path / "t.json"))
    gemm, gemv = rows[vt.GEMM], rows[vt.GEMV]
    assert (gemm.grid, gemm.block, gemm.blocks) == ((32, 32, 1), (128, 1, 1), 1024)
    assert (gemm.sms, gemm.underfilled) == (132, False)
    assert (gemv.blocks, gemv.underfilled) == (8, True)
    assert grid_text(gemv) == "8 blocks < 132 SMs" and grid_text(gemm) == "1,024 blocks"


def test_without_an_sm_count_nothing_is_flagged(tmp_path, monkeypatch):
    monkeypatch.setattr("fuselab.device.has_cuda", lambda: False)
    _, rows = _kernels(vt.kernel_mix(sms=None).write(tmp_path / "t.json"))
    assert rows[vt.GEMV].sms is None and not rows[vt.GEMV].underfilled and grid_text(rows[vt.GEMV]) == "8 blocks"


def test_nccl_kernels_are_communication(tmp_path):
    _, rows = _kernels(vt.overlapped_streams().write(tmp_path / "t.json"))
    nccl = rows[vt.NCCL_ALL_REDUCE]
    assert nccl.bound == "communication" and nccl.achieved is None and nccl.us_per_step == 250.0


@pytest.mark.parametrize("fixture, underfilled",
                         [("sync_bound", True), ("memory_bound", False), ("compute_bound", False)])
def test_recorded_traces_give_grids_and_sm_count(fixture, underfilled):
    d, _ = _kernels(FIXTURES / f"{fixture}.json.gz")
    top = d.views.kernels[0]
    assert top.sms == 132 and top.blocks is not None
    assert top.underfilled == underfilled  # batch-1 GEMV: 128 blocks; 16M-element multiply: 262,144; 8192^3 GEMM: 132
    assert sum(k.us_per_step for k in d.views.kernels) <= d.wall_us_per_step


def test_json_lists_every_kernel(tmp_path):
    d, _ = _kernels(vt.kernel_mix().write(tmp_path / "t.json"))
    out = d.to_dict()["kernels"]
    assert [k["name"] for k in out] == [vt.GEMM, vt.GEMV, vt.TRITON]
    assert out[1]["underfilled"] is True and out[1]["grid"] == (8, 1, 1)
