"""`fuselab probe` on a machine of several GPUs: what an NCCL all-reduce costs.

Tensor parallelism adds two all-reduces per layer to every decode step, of one step's hidden
states (batch × hidden × 2 bytes: 8-64 KB at decode), where latency is all that counts; large
ones (hundreds of MB) show the links' bandwidth. Per size: the latency of one all-reduce and its
bus bandwidth (nccl-tests' figure, bytes · 2(n−1)/n per second, comparable across GPU counts);
then how much of an all-reduce issued beside a matmul (on NCCL's own stream) the matmul hides.

The measuring functions run on every rank of an initialized process group (gloo on the CPU
too, which the tests use); `measure_collectives` starts one process per GPU to run them.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing

from fuselab.probe import _overlap_pct

DECODE_SIZES = (8 << 10, 16 << 10, 32 << 10, 64 << 10)
LARGE_SIZES = (1 << 20, 16 << 20, 256 << 20)
QUICK_LARGE_SIZES = (1 << 20, 16 << 20)
OVERLAP_BYTES = 64 << 20  # the all-reduce of the overlap test, and the side of its bf16 matmul
OVERLAP_SIDE = 8192
# A rank that has not finished by then is hung (a broken link, a peer that died): the probe gives up.
TIMEOUT_S = 300.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_us(fn, trials: int, device: torch.device) -> float:
    """Median over a few rounds of fn()'s time per call, every rank starting each round together;
    the slowest rank's figure, since a collective ends when its last rank does."""
    rounds = []
    for _ in range(3):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(trials):
            fn()
        _sync(device)
        rounds.append((time.perf_counter() - start) / trials * 1e6)
    slowest = torch.tensor([statistics.median(rounds)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def bus_bandwidth_gbs(nbytes: int, seconds: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: each byte crosses 2(n−1)/n links."""
    return nbytes * 2 * (world - 1) / world / seconds / 1e9


def measure_all_reduce(sizes: tuple[int, ...], trials: int, device: torch.device,
                       dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Per size in bytes: latency of one all-reduce (sum) in µs, algorithm and bus bandwidth."""
    world = dist.get_world_size()
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
        for _ in range(2):
            dist.all_reduce(x)  # warm-up: NCCL builds its channels on first use of a size
        # Fewer calls for large sizes: their time is bandwidth, stable in a few.
        us = _timed_us(lambda: dist.all_reduce(x), trials if nbytes <= (1 << 20) else max(2, trials // 10), device)
        rows.append({"bytes": nbytes, "latency_us": us, "algbw_gbs": nbytes / us / 1e3,
                     "busbw_gbs": bus_bandwidth_gbs(nbytes, us / 1e6, world)})
    return rows


def measure_overlap(nbytes: int, side: int, trials: int, device: torch.device,
                    dtype: torch.dtype = torch.bfloat16) -> dict:
    """An all-reduce issued asynchronously (NCCL runs it on its own stream; gloo on its thread)
    while a side × side matmul runs: µs of each alone and together, and the share of the shorter
    one hidden (100: fully, 0: the two ran one after the other)."""
    x = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
    a = torch.randn(side, side, dtype=dtype, device=device)
    c = torch.empty_like(a)

    def matmul() -> None:
        torch.mm(a, a, out=c)

    def together() -> None:
        work = dist.all_reduce(x, async_op=True)
        matmul()
        work.wait()

    for fn in (matmul, lambda: dist.all_reduce(x), together):
        fn()
    all_reduce_us = _timed_us(lambda: dist.all_reduce(x), trials, device)
    matmul_us = _timed_us(matmul, trials, device)
    together_us = _timed_us(together, trials, device)
    return {"bytes": nbytes, "matmul_side": side, "all_reduce_us": all_reduce_us, "matmul_us": matmul_us,
            "together_us": together_us, "hidden_pct": _overlap_pct(all_reduce_us, matmul_us, together_us)}


def _rank(rank: int, world: int, rendezvous: str, quick: bool, results) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S), device_id=device)
    try:
        trials = 20 if quick else 200
        result = {
            "gpus": world,
            "all_reduce": measure_all_reduce(DECODE_SIZES + (QUICK_LARGE_SIZES if quick else LARGE_SIZES), trials,
                                             device),
            "overlap": measure_overlap(OVERLAP_BYTES, OVERLAP_SIDE, 5 if quick else 20, device),
        }
        if rank == 0:
            results.put(result)
    finally:
        dist.destroy_process_group()


def measure_collectives(quick: bool = False) -> dict:
    """The all-reduce figures over every visible GPU (one process each); callers check that
    there are at least two."""
    world = torch.cuda.device_count()
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="fuselab-probe-") as directory:
        processes = torch.multiprocessing.start_processes(
            _rank, args=(world, str(Path(directory) / "rendezvous"), quick, results), nprocs=world, join=False,
            start_method="spawn")
        deadline = time.monotonic() + 2 * TIMEOUT_S
        # join() raises, naming the rank, if one fails; a hung one is killed at the deadline.
        while not processes.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in processes.processes:
                    p.kill()
                raise TimeoutError(f"the all-reduce probe did not finish within {2 * TIMEOUT_S:.0f} s")
    return results.get()


def verdict_line(collectives: dict) -> str:
    decode = [r for r in collectives["all_reduce"] if r["bytes"] <= DECODE_SIZES[-1]]
    large = collectives["all_reduce"][-1]
    overlap = collectives["overlap"]
    return (f"All-reduce over {collectives['gpus']} GPUs: {min(r['latency_us'] for r in decode):.0f}-"
            f"{max(r['latency_us'] for r in decode):.0f} us at decode sizes (two per layer per tensor-parallel step), "
            f"{large['busbw_gbs']:.0f} GB/s bus bandwidth at {large['bytes'] >> 20} MiB; a matmul beside a "
            f"{overlap['bytes'] >> 20} MiB all-reduce hides {overlap['hidden_pct']:.0f}% of the shorter.")
