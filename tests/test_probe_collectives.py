"""The all-reduce probe's measuring functions on two gloo ranks at tiny sizes (the GPU run uses
NCCL over every visible GPU), and how its figures are reported."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing

from fuselab.probe_collectives import bus_bandwidth_gbs, measure_all_reduce, measure_overlap, verdict_line
from fuselab.probe_report import COLLECTIVE_COLUMNS, _collective_rows


def _gloo_rank(rank, world, rendezvous, results):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        cpu = torch.device("cpu")
        result = {"gpus": world, "all_reduce": measure_all_reduce((8 << 10, 64 << 10), 3, cpu, torch.float32),
                  "overlap": measure_overlap(1 << 20, 128, 2, cpu, torch.float32)}
        if rank == 0:
            results.put(result)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def measured():
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.start_processes(_gloo_rank, args=(2, str(Path(directory) / "rendezvous"), results),
                                              nprocs=2, start_method="spawn")
    return results.get()


def test_all_reduce_rows_hold_latency_and_bandwidths(measured):
    rows = measured["all_reduce"]
    assert [r["bytes"] for r in rows] == [8 << 10, 64 << 10]
    for r in rows:
        assert r["latency_us"] > 0
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / r["latency_us"] / 1e3)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"])  # 2(n-1)/n = 1 for two ranks


def test_overlap_times_each_alone_and_together(measured):
    o = measured["overlap"]
    assert o["all_reduce_us"] > 0 and o["matmul_us"] > 0 and o["together_us"] > 0
    assert 0 <= o["hidden_pct"] <= 100


def test_bus_bandwidth_follows_nccl_tests():
    assert bus_bandwidth_gbs(1_000_000_000, 1.0, 8) == pytest.approx(1.75)


def test_figures_reach_the_verdict_and_the_tables(measured):
    line = verdict_line(measured)
    assert line.startswith("All-reduce over 2 GPUs:") and "% of the shorter" in line
    rows = _collective_rows(measured)
    assert [r[0] for r in rows] == ["8 KiB", "64 KiB", "1 MiB beside a 128² matmul"]
    assert all(len(r) == len(COLLECTIVE_COLUMNS) for r in rows)
