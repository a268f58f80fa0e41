"""Cross-entropy loss + gradient at 8192 x 128256 bf16: the log-sum-exp walk with one running (max, sum) per
lane of 8 logits (no block-wide reduction, no barrier, until the row's end) against main's walk (two block-wide
reductions a chunk), at 1 and 2 programs an SM.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-lanes-flash-tail/ce_lanes.py [RUN]

RUN 1, 2 or 3 picks the variant list of that run (ce_lanes-RUN.txt); without it, all three.
"""
import importlib
import sys

import torch
import triton
import triton.language as tl

from fuselab.kernels._launch import sm_count
from fuselab.timing import bench

ce = importlib.import_module("fuselab.kernels.cross_entropy")
_exp, _finite, _write_grad = ce._exp, ce._finite, ce._write_grad
VEC = 8


@triton.jit
def _lse_lanes(logits_row, n_vocab, CHUNK: tl.constexpr, VEC: tl.constexpr):
    lanes = tl.arange(0, CHUNK // VEC)
    cols = tl.arange(0, VEC)
    m = tl.full([CHUNK // VEC], float("-inf"), tl.float32)
    s = tl.zeros([CHUNK // VEC], tl.float32)
    for start in range(0, n_vocab, CHUNK):
        offs = start + lanes[:, None] * VEC + cols[None, :]
        x = tl.load(logits_row + offs, mask=offs < n_vocab, other=float("-inf"),
                    eviction_policy="evict_last").to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=1))
        shift = _finite(new_m)
        s = s * _exp(m - shift) + tl.sum(_exp(x - shift[:, None]), axis=1)
        m = new_m
    row_max = tl.max(m, axis=0)
    shift = _finite(row_max)
    return shift + tl.log(tl.sum(s * _exp(m - shift), axis=0))


@triton.jit
def _ce_kernel(logits_ptr, stride, target_ptr, row_loss_ptr, grad_ptr, n_rows, n_vocab, scale,
               CHUNK: tl.constexpr, GCHUNK: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr):
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row = tl.cast(row, tl.int64)
        base = logits_ptr + row * stride
        target = tl.load(target_ptr + row).to(tl.int64)
        if LANES:
            lse = _lse_lanes(base, n_vocab, CHUNK, VEC)
        else:
            m, s, _ = ce._lse_walk(base, 0, n_vocab, False, CHUNK, True)
            lse = _finite(m) + tl.log(s)
        tl.store(row_loss_ptr + row, lse - tl.load(base + target).to(tl.float32))
        _write_grad(base, grad_ptr + row * stride, target, 0, n_vocab, lse, scale, n_vocab, 0.0, False, GCHUNK)


def run(logits, target, per_sm, chunk, gchunk, warps, lanes, vec=VEC):
    n_rows, n_vocab = logits.shape
    loss = torch.empty(n_rows, device=logits.device)
    grad = torch.empty_like(logits)
    grid = (min(n_rows, int(per_sm * sm_count(logits.device))),)

    def step():
        _ce_kernel[grid](logits, logits.stride(0), target, loss, grad, n_rows, n_vocab, 1.0 / n_rows,
                         CHUNK=chunk, GCHUNK=gchunk, LANES=lanes, VEC=vec, num_warps=warps)
    step()
    ref = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")
    err = (loss - ref).abs().max().item()
    return bench(step).median_us, err


# (programs an SM, warps, lse chunk, gradient chunk, per-lane walk, logits a lane) of each run.
RUNS = {
    "1": [(2, 16, 16384, 16384, False, 8), (2, 16, 16384, 16384, True, 8), (2, 16, 32768, 16384, True, 8),
          (1, 32, 32768, 32768, True, 8), (1, 32, 32768, 16384, True, 8), (1, 32, 65536, 32768, True, 8),
          (1, 16, 32768, 16384, True, 8), (1, 32, 32768, 32768, False, 8), (2, 8, 16384, 8192, True, 8),
          (3, 8, 16384, 16384, True, 8), (4, 8, 8192, 8192, True, 8)],
    "2": [(1, 32, 32768, 32768, True, 8), (1, 32, 65536, 65536, True, 8), (1, 32, 16384, 32768, True, 8),
          (1, 32, 32768, 65536, True, 8), (1, 16, 16384, 16384, True, 8)],
    "3": [(1, 32, 32768, 32768, True, 8), (1, 32, 32768, 32768, True, 16), (1, 32, 32768, 32768, True, 4),
          (0.75, 32, 32768, 32768, True, 8), (0.5, 32, 32768, 32768, True, 8), (1.5, 16, 16384, 16384, True, 8)],
}


def main():
    variants = [v for run in (sys.argv[1:] or RUNS) for v in RUNS[run]]
    dev = torch.device("cuda")
    for rows in (8192, 1024):
        logits = torch.randn(rows, 128256, device=dev, dtype=torch.bfloat16)
        target = torch.randint(0, 128256, (rows,), device=dev)
        mb = 2 * logits.numel() * 2
        main_us = bench(lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, write_grad=True)).median_us
        print(f"rows {rows}: main {main_us:.1f} us ({mb / main_us / 1e6:.0f} GB/s, 1 read + 1 write)", flush=True)
        results = []
        for per_sm, warps, chunk, gchunk, lanes, vec in variants:
            try:
                us, err = run(logits, target, per_sm, chunk, gchunk, warps, lanes, vec)
            except Exception as e:  # noqa: BLE001
                print(f"  per_sm={per_sm} warps={warps} chunk={chunk}/{gchunk} lanes={lanes} vec={vec}: failed {str(e)[:200]}", flush=True)
                continue
            results.append((us, per_sm, warps, chunk, gchunk, lanes, vec))
            print(f"  per_sm={per_sm} warps={warps} chunk={chunk}/{gchunk} lanes={lanes} vec={vec}: {us:8.1f} us "
                  f"{mb / us / 1e6:5.0f} GB/s  loss err {err:.1e}", flush=True)
        print("  best:", sorted(results)[:3], flush=True)
        del logits


if __name__ == "__main__":
    main()
