"""Why rope's forward, as the bench times it (CUDA events, L2 flushed between calls, no host lead), takes 49 and
105 us at 32 and 4096 tokens when its GPU time is a few tens: host time per call, the flush's GPU time, and the
event figure with and without the flush and with the host ahead, for fuselab and torch.compile.

    PYTHONPATH=. python3 exp/rope_host.py
"""
import statistics
import time

import torch

from fuselab import timing
from fuselab.bench.kernels import _build_rope, forward_step
from fuselab.kernels import apply_rope, reference
from fuselab.timing import bench


def host_issue_us(fn, n=50):
    samples = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples), max(samples)


def loop_host_us(fn, n=50):
    """Host time per iteration of the bench's timed loop (flush, event, call, event), no sync inside."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timing._flush_l2()
        s.record()
        fn()
        e.record()
    host = (time.perf_counter() - t) * 1e6 / n
    torch.cuda.synchronize()
    return host


def main():
    flush = bench(timing._flush_l2, flush_l2=False).median_us
    print(f"L2 flush (zero a {timing._l2_flush_buffers[torch.cuda.current_device()].numel() >> 20} MB buffer): {flush:.1f} us of GPU time")
    compiled = torch.compile(reference.apply_rope, dynamic=False)
    for tokens in (1, 32, 4096, 16384):
        w = _build_rope(tokens, torch.bfloat16, torch.device("cuda"))
        for name, fn in (("fuselab", apply_rope), ("torch.compile", compiled)):
            step = forward_step(fn, w)
            for _ in range(20):
                step()
            h_med, h_max = host_issue_us(step)
            loop = loop_host_us(step)
            ev = bench(step).median_us
            ev_nf = bench(step, flush_l2=False).median_us
            gpu = bench(step, host_ahead=True).median_us
            print(f"{tokens:6d} tokens {name:14s} host issue {h_med:6.1f} us (max {h_max:6.1f}); bench loop host {loop:6.1f} us/iter; "
                  f"events {ev:6.1f} us, no flush {ev_nf:6.1f}, host ahead {gpu:6.1f}", flush=True)
    w = _build_rope(32, torch.bfloat16, torch.device("cuda"))
    step = forward_step(apply_rope, w)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
