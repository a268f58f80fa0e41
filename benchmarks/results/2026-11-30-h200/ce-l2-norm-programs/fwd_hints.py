"""rms_norm and softmax forwards: eviction hints, exp2 and a reciprocal, warps; against main's and the others.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-l2-norm-programs/fwd_hints.py
"""
import torch
import triton
import triton.language as tl

from fuselab.timing import bench


@triton.jit
def _rms_fwd(X, W, Y, n_cols, eps, BLOCK: tl.constexpr, HINTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    if HINTS:
        w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if HINTS:
        tl.store(Y + offs, (x * rstd * w).to(Y.dtype.element_ty), mask=mask, cache_modifier=".cs")
    else:
        tl.store(Y + offs, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_fwd(X, Y, n_cols, BLOCK: tl.constexpr, HINTS: tl.constexpr, FAST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    if HINTS:
        x = tl.load(X + offs, mask=mask, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(X + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if FAST:
        e = tl.math.exp2((x - tl.max(x, axis=0)) * 1.4426950408889634)
        y = e * (1.0 / tl.sum(e, axis=0))
    else:
        e = tl.exp(x - tl.max(x, axis=0))
        y = e / tl.sum(e, axis=0)
    if HINTS:
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask, cache_modifier=".cs")
    else:
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def main():
    dev = torch.device("cuda")
    from fuselab.kernels import rms_norm, softmax
    for rows, cols in ((16384, 8192), (4096, 4096)):
        x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16)
        w = torch.randn(cols, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        mb = 2 * x.numel() * 2 / 1e6
        block = triton.next_power_of_2(cols)
        line = f"rms {rows}x{cols}: main {bench(lambda: rms_norm(x, w)).median_us:.1f}"
        comp = torch.compile(lambda a, b: torch.nn.functional.rms_norm(a, (cols,), b, 1e-6))
        line += f"  compile {bench(lambda: comp(x, w)).median_us:.1f}"
        for warps in (4, 8, 16):
            for hints in (False, True):
                t = bench(lambda: _rms_fwd[(rows,)](x, w, y, cols, 1e-6, BLOCK=block, HINTS=hints, num_warps=warps)).median_us
                line += f"  w{warps}{'h' if hints else ''} {t:.1f}"
        print(line, f"(ideal {mb / 4.242:.1f})", flush=True)
        line = f"softmax {rows}x{cols}: main {bench(lambda: softmax(x)).median_us:.1f}"
        try:
            from liger_kernel.ops.softmax import LigerSoftmaxFunction
            line += f"  liger {bench(lambda: LigerSoftmaxFunction.apply(x)).median_us:.1f}"
        except ImportError:
            pass
        for warps in (4, 8, 16):
            for hints in (False, True):
                for fast in (False, True):
                    t = bench(lambda: _softmax_fwd[(rows,)](x, y, cols, BLOCK=block, HINTS=hints, FAST=fast, num_warps=warps)).median_us
                    line += f"  w{warps}{'h' if hints else ''}{'f' if fast else ''} {t:.1f}"
        print(line, f"(ideal {mb / 4.242:.1f})", flush=True)


if __name__ == "__main__":
    main()
