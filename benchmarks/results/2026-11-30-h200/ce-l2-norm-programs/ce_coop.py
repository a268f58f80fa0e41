"""Cross-entropy loss+gradient with one read of the logits: S co-resident programs share a row, each keeps
its part in registers, and they exchange (max, sum) through global memory (cooperative launch).

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-l2-norm-programs/ce_coop.py
"""
import importlib

import torch
import triton
import triton.language as tl

from fuselab.kernels._launch import sm_count
from fuselab.timing import bench

ce = importlib.import_module("fuselab.kernels.cross_entropy")
LOG2E = 1.4426950408889634


@triton.jit
def _load_part(logits_ptr, stride, row, n_rows, lo, hi, offs):
    ok = offs < tl.where(row < n_rows, hi, 0)
    return tl.load(logits_ptr + tl.cast(row, tl.int64) * stride + offs, mask=ok, other=float("-inf"),
                   eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _ce_coop_kernel(
    logits_ptr, stride, target_ptr, row_loss_ptr, grad_ptr, part_ptr, counter_ptr, n_rows, n_vocab, span, scale,
    S: tl.constexpr, PART: tl.constexpr, PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    part = pid % S
    rows_at_once = tl.num_programs(0) // S
    lo = part * span
    hi = tl.minimum(lo + span, n_vocab)
    offs = lo + tl.arange(0, PART)
    first = pid // S
    x = _load_part(logits_ptr, stride, first, n_rows, lo, hi, offs)
    for row in range(first, n_rows, rows_at_once):
        row64 = tl.cast(row, tl.int64)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.math.exp2((x - m) * 1.4426950408889634), axis=0)
        tl.store(part_ptr + (row64 * S + part) * 2, m)
        tl.store(part_ptr + (row64 * S + part) * 2 + 1, s)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + row64, 1, sem="acq_rel") + 1
        if PREFETCH:
            x_next = _load_part(logits_ptr, stride, row + rows_at_once, n_rows, lo, hi, offs)
        while arrived < S:
            arrived = tl.atomic_add(counter_ptr + row64, 0, sem="acquire")
        parts = tl.arange(0, S)
        pm = tl.load(part_ptr + (row64 * S + parts) * 2, volatile=True)
        ps = tl.load(part_ptr + (row64 * S + parts) * 2 + 1, volatile=True)
        big = tl.max(pm, axis=0)
        lse = big + tl.log2(tl.sum(ps * tl.math.exp2((pm - big) * 1.4426950408889634), axis=0)) / 1.4426950408889634
        target = tl.load(target_ptr + row64).to(tl.int64)
        g = tl.math.exp2((x - lse) * 1.4426950408889634)
        g = tl.where(offs == target, g - 1.0, g) * scale
        tl.store(grad_ptr + row64 * stride + offs, g.to(grad_ptr.dtype.element_ty), mask=offs < hi, cache_modifier=".cs")
        if part == 0:
            xt = tl.load(logits_ptr + row64 * stride + target).to(tl.float32)
            tl.store(row_loss_ptr + row64, lse - xt)
        if PREFETCH:
            x = x_next
        else:
            x = _load_part(logits_ptr, stride, row + rows_at_once, n_rows, lo, hi, offs)


def run_variant(logits, target, S, warps, per_sm, prefetch):
    n_rows, n_vocab = logits.shape
    sms = sm_count(logits.device)
    rows_at_once = min(n_rows, (per_sm * sms) // S)
    grid = (rows_at_once * S,)
    span = triton.cdiv(n_vocab, S)
    part_block = triton.next_power_of_2(span)
    loss = torch.empty(n_rows, device=logits.device)
    grad = torch.empty_like(logits)
    parts = torch.empty(n_rows, S, 2, device=logits.device)

    def step():
        counters = torch.zeros(n_rows, dtype=torch.int32, device=logits.device)
        _ce_coop_kernel[grid](logits, logits.stride(0), target, loss, grad, parts, counters, n_rows, n_vocab, span,
                              1.0 / n_rows, S=S, PART=part_block, PREFETCH=prefetch, num_warps=warps,
                              launch_cooperative_grid=True)
    step()
    torch.cuda.synchronize()
    ref_l = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")
    xr = logits.float().requires_grad_(True)
    torch.nn.functional.cross_entropy(xr, target).backward()
    err = (loss - ref_l).abs().max().item(), (grad.float() - xr.grad).abs().max().item() * n_rows
    return bench(step).median_us, err


def main():
    dev = torch.device("cuda")
    for rows in (8192, 1024):
        logits = torch.randn(rows, 128256, device=dev, dtype=torch.bfloat16)
        target = torch.randint(0, 128256, (rows,), device=dev)
        mb = 2 * logits.numel() * 2 / 1e6
        cur = bench(lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, write_grad=True)).median_us
        print(f"rows {rows}: main's fused fwd+grad {cur:.1f} us ({mb / cur:.2f} TB/s for 1 read + 1 write)", flush=True)
        zeros = bench(lambda: torch.zeros(rows, dtype=torch.int32, device=dev)).median_us
        print(f"  counters memset alone {zeros:.1f} us", flush=True)
        for S, warps, per_sm in ((4, 32, 1), (8, 16, 2), (8, 32, 1), (16, 8, 4), (16, 16, 2), (8, 8, 4)):
            for prefetch in (False, True):
                try:
                    t, err = run_variant(logits, target, S, warps, per_sm, prefetch)
                except Exception as e:  # noqa: BLE001
                    print(f"  S={S} warps={warps} per_sm={per_sm} prefetch={prefetch}: failed {type(e).__name__} {str(e)[:300]}", flush=True)
                    continue
                print(f"  S={S} warps={warps} per_sm={per_sm} prefetch={prefetch}: {t:8.1f} us "
                      f"{mb / t:.2f} TB/s  loss err {err[0]:.1e} grad err (x rows) {err[1]:.1e}", flush=True)


if __name__ == "__main__":
    main()
