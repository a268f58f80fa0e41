import argparse
from pathlib import Path

import pytest
import torch

from fuselab.bench import kernels as bench_kernels


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_kernels.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_options_parse():
    args = _args("--ops", "rms_norm,swiglu", "--quick", "--out", "somewhere")
    assert args.ops == ["rms_norm", "swiglu"] and args.quick and args.out == "somewhere"
    assert _args().ops is None and _args().dtype == "bfloat16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_without_a_gpu_it_says_so_and_succeeds(capsys, tmp_path):
    assert bench_kernels.run(_args("--out", str(tmp_path))) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("op", bench_kernels.ops(), ids=lambda op: op.name)
def test_every_case_runs_and_agrees_with_its_reference(device, op):
    # The decode size is small enough for the interpreter; fp32 so the two sides agree closely.
    workload = op.sizes["decode"](torch.float32, device)
    assert workload.bytes_forward > 0 and set(op.sizes) == set(bench_kernels.SIZES)
    ours, eager = op.ours(*workload.args), op.eager(*workload.args)
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
    if workload.grad_args:
        grads = bench_kernels.forward_backward_step(op.ours, workload)()
        assert len(grads) == len(workload.grad_args)


def _fake_result() -> dict:
    records = [
        {"op": "rms_norm", "size": "large", "shape": "16384×8192", "pass": "forward", "impl": impl, "bytes": 536870912,
         "median_us": us, "gbs": 536870912 / us / 1e3, "pct_of_copy": 536870912 / us / 1e3 / 42.3, "error": None}
        for impl, us in (("fuselab", 140.0), ("torch eager", 1700.0), ("torch.compile", 250.0))
    ]
    records.append({**records[0], "impl": "liger", "median_us": None, "gbs": None, "pct_of_copy": None, "error": "boom"})
    return {
        "date": "2026-12-01T00:00:00+00:00", "command": "fuselab bench kernels",
        "device": {"name": "GPU", "compute_capability": "9.0", "torch": "2.11", "triton": "3.6", "cuda": "13.0"},
        "ceilings": {"copy_bandwidth_gbs": 4230.0, "source": "stated"},
        "config": {"dtype": "bfloat16", "timing": "median"},
        "results": records,
        "host_us_per_call": [{"op": "rms_norm", "impl": "fuselab", "host_us": 9.5}],
    }


def test_tables_show_each_implementation_and_the_speedup(tmp_path: Path):
    rows = bench_kernels.table_rows(_fake_result())
    assert len(rows) == 1
    row = dict(zip(bench_kernels.TABLE_COLUMNS, rows[0]))
    assert row["fuselab"].startswith("140.0 µs") and row["liger"] == "error"
    assert row["speed-up vs best other"] == "1.79×"
    bench_kernels.write_markdown(_fake_result(), tmp_path / "kernels.md")
    text = (tmp_path / "kernels.md").read_text()
    assert "GPU: GPU (sm 9.0), torch 2.11, triton 3.6" in text and "| rms_norm | 9.5 |" in text


def test_forward_backward_gets_a_second_table_of_gpu_time(tmp_path: Path):
    result = _fake_result()
    for impl, us, gpu_us in (("fuselab", 600.0, 300.0), ("torch.compile", 500.0, 450.0)):
        result["results"].append({
            "op": "rms_norm", "size": "large", "shape": "16384×8192", "pass": "forward+backward", "impl": impl,
            "bytes": 1342177280, "median_us": us, "gbs": 1342177280 / us / 1e3, "pct_of_copy": 1342177280 / us / 1e3 / 42.3,
            "error": None, "gpu_us": gpu_us, "gpu_pct_of_copy": 1342177280 / gpu_us / 1e3 / 42.3,
        })
    host_issued = {r[3]: r for r in bench_kernels.table_rows(result)}
    assert host_issued["forward+backward"][-1] == "0.83×"  # slower as the host issues it...
    gpu = bench_kernels.table_rows(result, "gpu_us")
    assert len(gpu) == 1 and gpu[0][3] == "forward+backward"
    assert gpu[0][5].startswith("300.0 µs") and gpu[0][-1] == "1.50×"  # ...faster on the GPU
    bench_kernels.write_markdown(result, tmp_path / "kernels.md")
    assert "host running ahead" in (tmp_path / "kernels.md").read_text()
