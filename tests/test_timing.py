import json
import time

import pytest
import torch

from fuselab.timing import NULL_TIMER, BenchResult, Timer, Timers, bench, cuda_timer


def test_timer_accumulates_until_reset():
    t = Timer("work")
    for _ in range(3):
        t.start()
        time.sleep(0.01)
        t.stop()
    assert t.count == 3
    first = t.elapsed(reset=False)
    assert 0.03 <= first < 0.5
    assert t.elapsed(reset=True) == pytest.approx(first)
    assert t.elapsed() == 0.0 and t.count == 0


def test_elapsed_of_running_timer_keeps_it_running():
    t = Timer("run")
    t.start()
    time.sleep(0.01)
    assert t.elapsed(reset=True) >= 0.01
    assert t.active
    t.stop()
    assert t.count == 1


def test_timer_misuse_is_reported():
    t = Timer("x")
    with pytest.raises(RuntimeError, match="without start"):
        t.stop()
    t.start()
    with pytest.raises(RuntimeError, match="started twice"):
        t.start()


def test_timers_above_log_level_are_free_noops():
    timers = Timers(log_level=1)
    kept = timers("forward", log_level=1)
    dropped = timers("fine-grained", log_level=2)
    assert isinstance(kept, Timer) and kept is not NULL_TIMER
    assert dropped is NULL_TIMER
    dropped.start()
    dropped.start()  # no state, so no "started twice" either
    dropped.stop()
    assert dropped.elapsed() == 0.0
    assert timers.names == ["forward"]


def test_timers_same_name_returns_same_timer_and_level_conflict_errors():
    timers = Timers(log_level=2)
    assert timers("a", log_level=1) is timers("a")
    with pytest.raises(ValueError, match="log_level"):
        timers("a", log_level=2)
    with pytest.raises(ValueError, match="log_level"):
        Timers(log_level=-1)


def test_timers_summary_dict_json_table_and_log(tmp_path):
    timers = Timers()
    with timers("step"):
        time.sleep(0.005)
    with timers("step"):
        time.sleep(0.005)
    d = timers.to_dict()
    assert d["step"]["count"] == 2
    assert d["step"]["total_ms"] >= 10
    assert d["step"]["mean_ms"] == pytest.approx(d["step"]["total_ms"] / 2)
    path = tmp_path / "timers.json"
    timers.to_json(str(path))
    assert json.loads(path.read_text())["step"]["count"] == 2
    assert timers.table().row_count == 1
    line = timers.log(reset=True)
    assert line.startswith("time (ms) | step: ")
    assert timers.to_dict()["step"]["count"] == 0


def test_reporting_a_running_timer_is_an_error():
    timers = Timers()
    timers("open").start()
    with pytest.raises(RuntimeError, match="still running"):
        timers.to_dict()


def test_cuda_timer_falls_back_to_wall_clock_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    with cuda_timer() as t:
        time.sleep(0.01)
    assert t.source == "wall-clock"
    assert t.ms >= 10


def test_bench_on_cpu_uses_wall_clock_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    with pytest.warns(UserWarning, match="host clock"):
        r = bench(lambda: time.sleep(0.001), rep_ms=20, warmup_ms=1)
    assert isinstance(r, BenchResult)
    assert r.mode == "wall-clock" and not r.flush_l2
    assert 1000 <= r.median_us < 50_000
    q = r.quantiles_us
    assert q[0.2] <= q[0.5] <= q[0.8]
    assert q[0.5] == pytest.approx(r.median_us)
    assert r.min_us <= r.median_us <= r.max_us
    assert r.reps >= 10


def test_bench_rep_count_follows_the_estimate():
    with pytest.warns(UserWarning):
        fast = bench(lambda: None, rep_ms=5, warmup_ms=0, device="cpu", max_reps=500)
        slow = bench(lambda: time.sleep(0.002), rep_ms=20, warmup_ms=0, device="cpu")
    assert fast.reps == 500  # capped
    assert 10 <= slow.reps <= 12  # ~20 ms / 2 ms, floored at min_reps


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fn=42), "fn must be a callable"),
        (dict(rep_ms=0), "rep_ms"),
        (dict(warmup_ms=-1), "warmup_ms"),
        (dict(quantiles=(0.5, 1.5)), "quantiles"),
        (dict(quantiles=()), "quantiles"),
        (dict(min_reps=0), "min_reps"),
    ],
)
def test_bench_bad_input(kwargs, match):
    fn = kwargs.pop("fn", lambda: None)
    with pytest.raises((TypeError, ValueError), match=match):
        bench(fn, **kwargs)


def test_bench_cuda_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    with pytest.raises(ValueError, match="no CUDA device"):
        bench(lambda: None, device="cuda")


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_unsynced_host_clock_reports_a_fraction_of_the_real_time():
    """The pitfall: a host clock around async GPU work without a sync measures only the launches."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def work():
        for _ in range(20):
            a @ a

    work()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    work()
    unsynced = time.perf_counter() - t0
    torch.cuda.synchronize()
    timer = Timer("synced")
    timer.start()
    work()
    timer.stop()
    synced = timer.elapsed()
    assert unsynced < 0.5 * synced, (unsynced, synced)


@pytest.mark.gpu
def test_cuda_timer_agrees_with_synced_timer_and_does_not_sync():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with cuda_timer() as t:
        for _ in range(20):
            a @ a
    host_inside = time.perf_counter() - t0
    gpu_ms = t.ms
    assert t.source == "cuda-events"
    assert host_inside * 1e3 < 0.5 * gpu_ms  # the region returned before the GPU finished: no sync inside
    with Timer("s") as timer:
        for _ in range(20):
            a @ a
    assert gpu_ms == pytest.approx(timer.elapsed() * 1e3, rel=0.25)


@pytest.mark.gpu
def test_bench_graph_mode_removes_launch_overhead():
    x = torch.randn(256, device="cuda")

    def chain():
        for _ in range(50):
            x.add_(1.0)

    eager = bench(chain, rep_ms=50)
    graphed = bench(chain, rep_ms=50, cuda_graph=True)
    assert eager.mode == "cuda-events" and graphed.mode == "cuda-graph"
    assert graphed.median_us < 0.5 * eager.median_us, (graphed, eager)


@pytest.mark.gpu
def test_bench_host_ahead_times_the_kernels_not_the_host():
    """A call whose host side takes 2 ms before one short kernel: event timing sees the 2 ms, host_ahead the kernel."""
    x = torch.randn(4096, device="cuda")

    def slow_host():
        time.sleep(0.002)
        x.add_(1.0)

    plain = bench(slow_host, rep_ms=30)
    ahead = bench(slow_host, rep_ms=30, host_ahead=True)
    assert ahead.mode == "cuda-events, host ahead"
    assert plain.median_us > 1500, plain
    assert ahead.median_us < 200, ahead


def test_bench_host_ahead_refuses_graph_mode():
    with pytest.raises(ValueError, match="host_ahead"):
        bench(lambda: None, cuda_graph=True, host_ahead=True)


@pytest.mark.gpu
def test_bench_matches_a_known_memory_bound_time():
    x = torch.randn(256 * 2**20 // 4, device="cuda")
    y = torch.empty_like(x)
    r = bench(lambda: y.copy_(x), rep_ms=50)
    tbps = 2 * x.nbytes / (r.median_us * 1e-6) / 1e12
    assert 0.5 < tbps < 6.0  # HBM-class bandwidth: the events time the kernel, not the launch


@pytest.mark.gpu
def test_bench_graph_mode_names_capture_unsafe_code():
    x = torch.randn(8, device="cuda")
    with pytest.raises(RuntimeError, match="could not be captured"):
        bench(lambda: x.sum().item(), cuda_graph=True)


@pytest.mark.gpu
def test_random_ops_work_after_a_failed_capture():
    x = torch.randn(8, device="cuda")
    with pytest.raises(RuntimeError, match="could not be captured"):
        bench(lambda: x.sum().item(), cuda_graph=True)
    assert torch.randn(4, device="cuda").isfinite().all()
    g = bench(lambda: torch.randn(64, device="cuda"), cuda_graph=True, rep_ms=5)
    assert g.mode == "cuda-graph"
