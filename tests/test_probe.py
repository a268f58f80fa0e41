import json
import subprocess
import sys

import pytest
import torch

from fuselab.probe import _overlap_pct, crossover_side, run_probe, verdict


def test_crossover_interpolates_log_log():
    sides = [256, 512, 1024, 2048]
    kernel_us = [1.0, 2.0, 8.0, 32.0]
    assert crossover_side(sides, kernel_us, 4.0) == pytest.approx(724.08, rel=1e-3)  # halfway in log space
    assert crossover_side(sides, kernel_us, 8.0) == pytest.approx(1024)
    assert crossover_side(sides, kernel_us, 0.5) == 256  # already above at the smallest size
    assert crossover_side(sides, kernel_us, 100.0) is None  # never reached


def test_overlap_percentage():
    assert _overlap_pct(100, 100, 100) == 100  # fully hidden
    assert _overlap_pct(100, 100, 200) == 0  # serial
    assert _overlap_pct(50, 100, 125) == 50
    assert _overlap_pct(50, 100, 300) == 0  # slower than serial clamps at 0


def _gpu_like_result():
    return {
        "launch": {"launch_overhead_us": 7.6, "graph_us_per_kernel": 1.2, "eager_over_graph": 7.3, "eager_us_per_kernel": 8.8},
        "size_sweep": {"crossover_side": 2000.0, "crossover_bytes": 8 * 2000 * 2000},
        "sync": {"idle_device_us": {"torch.cuda.synchronize()": 5.0, "tensor.item()": 20.0}},
        "ceilings": {"copy_bandwidth_gbs": 4230.0, "bf16_tflops": 780.0, "ridge_flop_per_byte": 184.4},
        "streams": {"overlap_pct": 95.0, "pageable_overlap_pct": 3.0},
    }


def test_verdict_states_the_launch_rule_from_measured_figures():
    lines = verdict(_gpu_like_result())
    text = "\n".join(lines)
    assert ">= 68 us" in text  # 7.6 us * 0.9 / 0.1
    assert "5 us (synchronize) to 20 us (tensor.item())" in text
    assert "4.23 TB/s" in text and "780 TFLOP/s" in text
    assert "95% hidden" in text


def test_probe_on_cpu_runs_and_lists_what_it_skipped():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    result = run_probe(quick=True)
    assert {s["section"] for s in result["skipped"]} == {"graph", "sync", "streams"}
    assert result["launch"]["eager_us_per_kernel"] > 0
    assert result["ceilings"]["copy_bandwidth_gbs"] > 0
    assert any("No CUDA GPU" in line for line in result["verdict"])
    json.dumps(result)  # serializable as is


def test_probe_cli_on_cpu_exits_zero_and_writes_json_and_plot(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    out, png, md = tmp_path / "probe.json", tmp_path / "probe.png", tmp_path / "probe.md"
    proc = subprocess.run(
        [sys.executable, "-m", "fuselab", "probe", "--quick", "--json", str(out), "--plot", str(png), "--markdown", str(md)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "needs a CUDA GPU" in proc.stdout
    assert json.loads(out.read_text())["meta"]["kind"] == "cpu"
    assert png.stat().st_size > 10_000
    text = md.read_text()
    assert "| launch | CPU time to issue one launch (no sync) |" in text
    assert "skipped sync: host-device sync cost needs a CUDA GPU" in text


@pytest.mark.gpu
def test_probe_on_gpu_orders_graph_eager_synced():
    result = run_probe(quick=True)
    launch = result["launch"]
    assert launch["graph_us_per_kernel"] < launch["eager_us_per_kernel"] < launch["synced_us_per_kernel"]
    assert result["streams"]["event_ordering_correct"]
    assert result["ceilings"]["copy_bandwidth_gbs"] > 1000
    assert result["ceilings"]["bf16_tflops"] > 100
    assert not result["skipped"]
