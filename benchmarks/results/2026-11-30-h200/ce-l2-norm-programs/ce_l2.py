"""Does cross-entropy's second walk over a row (the gradient) hit L2? Variants of the fused kernel.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-l2-norm-programs/ce_l2.py
"""
import importlib

import torch
import triton
import triton.language as tl

ce = importlib.import_module("fuselab.kernels.cross_entropy")
from fuselab.kernels._launch import sm_count
from fuselab.timing import bench


@triton.jit
def _ce_exp_kernel(
    logits_ptr, stride, target_ptr, row_loss_ptr, grad_ptr, n_rows, n_vocab, scale,
    CHUNK: tl.constexpr, HINTS: tl.constexpr, REVERSE: tl.constexpr, STORE_CS: tl.constexpr,
    PERSISTENT: tl.constexpr, STAGES: tl.constexpr,
):
    cols = tl.arange(0, CHUNK)
    n_chunks = tl.cdiv(n_vocab, CHUNK)
    if PERSISTENT:
        first = tl.program_id(0)
        step = tl.num_programs(0)
    else:
        first = tl.program_id(0)
        step = n_rows
    for row in range(first, n_rows, step):
        row64 = tl.cast(row, tl.int64)
        base = logits_ptr + row64 * stride
        gbase = grad_ptr + row64 * stride
        target = tl.load(target_ptr + row64).to(tl.int64)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        for c in tl.range(0, n_chunks, num_stages=STAGES):
            offs = c * CHUNK + cols
            ok = offs < n_vocab
            if HINTS:
                x = tl.load(base + offs, mask=ok, other=float("-inf"), eviction_policy="evict_last").to(tl.float32)
            else:
                x = tl.load(base + offs, mask=ok, other=float("-inf")).to(tl.float32)
            nm = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.math.exp2((m - nm) * 1.4426950408889634) + tl.sum(tl.math.exp2((x - nm) * 1.4426950408889634), axis=0)
            m = nm
        lse = m + tl.log(s)
        xt = tl.load(base + target).to(tl.float32)
        tl.store(row_loss_ptr + row64, lse - xt)
        for i in tl.range(0, n_chunks, num_stages=STAGES):
            if REVERSE:
                c = n_chunks - 1 - i
            else:
                c = i
            offs = c * CHUNK + cols
            ok = offs < n_vocab
            if HINTS:
                x = tl.load(base + offs, mask=ok, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
            else:
                x = tl.load(base + offs, mask=ok, other=float("-inf")).to(tl.float32)
            g = tl.math.exp2((x - lse) * 1.4426950408889634)
            g = tl.where(offs == target, g - 1.0, g) * scale
            if STORE_CS:
                tl.store(gbase + offs, g.to(grad_ptr.dtype.element_ty), mask=ok, cache_modifier=".cs")
            else:
                tl.store(gbase + offs, g.to(grad_ptr.dtype.element_ty), mask=ok)


def run_variant(logits, target, per_sm, chunk, warps, hints, reverse, cs, stages):
    n_rows, n_vocab = logits.shape
    loss = torch.empty(n_rows, device=logits.device)
    grad = torch.empty_like(logits)
    persistent = per_sm > 0
    grid = (min(n_rows, int(per_sm * sm_count(logits.device))),) if persistent else (n_rows,)

    def step():
        _ce_exp_kernel[grid](logits, logits.stride(0), target, loss, grad, n_rows, n_vocab, 1.0 / n_rows,
                             CHUNK=chunk, HINTS=hints, REVERSE=reverse, STORE_CS=cs, PERSISTENT=persistent, STAGES=stages,
                             num_warps=warps)
    step()
    ref = ce._cross_entropy_forward(logits, target, -100, "none", 0.0, write_grad=False)[0].float()
    err = (loss - ref).abs().max().item()
    return bench(step).median_us, err


def main():
    dev = torch.device("cuda")
    for rows in (8192, 1024):
        logits = torch.randn(rows, 128256, device=dev, dtype=torch.bfloat16)
        target = torch.randint(0, 128256, (rows,), device=dev)
        mb = 2 * logits.numel() * 2 / 1e6
        cur = bench(lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, write_grad=True)).median_us
        print(f"rows {rows}: current fused fwd+grad {cur:.1f} us ({mb / cur:.2f} TB/s for 1 read + 1 write)", flush=True)
        variants = [(0, 4096, 8, False, False, False, 1), (2, 16384, 16, True, True, True, 1)]
        for per_sm in (0.5, 1, 2):
            for chunk, warps in ((4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32)):
                for stages in (2, 3, 4):
                    variants.append((per_sm, chunk, warps, True, True, True, stages))
        variants += [(1, 8192, 16, False, False, False, 3), (1, 8192, 16, True, False, False, 3),
                     (1, 8192, 16, False, True, False, 3), (1, 8192, 16, True, True, False, 3)]
        results = []
        for v in variants:
            try:
                t, err = run_variant(logits, target, *v)
            except Exception as e:  # noqa: BLE001
                print("  failed", v, type(e).__name__, str(e)[:200], flush=True)
                continue
            results.append((t, v))
            print(f"  per_sm={v[0]} chunk={v[1]} warps={v[2]} hints={v[3]} reverse={v[4]} cs={v[5]} stages={v[6]}: "
                  f"{t:8.1f} us  {mb / t:.2f} TB/s  err {err:.1e}", flush=True)
        results.sort()
        print("best:", results[:5], flush=True)


if __name__ == "__main__":
    main()
