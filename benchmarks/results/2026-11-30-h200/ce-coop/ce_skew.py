"""Cross-entropy loss + gradient with the two walks of consecutive rows interleaved: each step reads a chunk
of the next row (its log-sum-exp, from HBM) and the same chunk of this row again (its gradient), so every
byte is read the second time one row's walk after the first, and reads, re-reads and writes stream together.

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-coop/ce_skew.py     (ce_skew.txt)
"""
import importlib
import sys

import torch
import triton
import triton.language as tl

from fuselab.kernels._launch import sm_count
from fuselab.timing import bench

ce = importlib.import_module("fuselab.kernels.cross_entropy")
_exp, _finite, _lse_lanes = ce._exp, ce._finite, ce._lse_lanes


@triton.jit
def _skew_kernel(logits_ptr, stride, target_ptr, row_loss_ptr, grad_ptr, n_rows, n_vocab, scale,
                 CHUNK: tl.constexpr, LANE: tl.constexpr, EV_NEXT: tl.constexpr, EV_CUR: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_lane = tl.arange(0, CHUNK // LANE)[:, None] * LANE + tl.arange(0, LANE)[None, :]
    m0, s0, _ = _lse_lanes(logits_ptr + tl.cast(pid, tl.int64) * stride, n_vocab, False, CHUNK, LANE)
    lse = _finite(m0) + tl.log(s0)
    for row in range(pid, n_rows, programs):
        row = tl.cast(row, tl.int64)
        nxt = row + programs
        next_limit = tl.where(nxt < n_rows, n_vocab, 0)
        cur_row = logits_ptr + row * stride
        next_row = logits_ptr + nxt * stride
        grad_row = grad_ptr + row * stride
        target = tl.load(target_ptr + row).to(tl.int64)
        lane_max = tl.full([CHUNK // LANE], float("-inf"), tl.float32)
        lane_sum = tl.zeros([CHUNK // LANE], tl.float32)
        for start in range(0, n_vocab, CHUNK):
            offs = start + offs_lane
            in_row = offs < n_vocab
            xn = tl.load(next_row + offs, mask=offs < next_limit, other=float("-inf"), eviction_policy=EV_NEXT).to(tl.float32)
            new_max = tl.maximum(lane_max, tl.max(xn, axis=1))
            shift = _finite(new_max)
            lane_sum = lane_sum * _exp(lane_max - shift) + tl.sum(_exp(xn - shift[:, None]), axis=1)
            lane_max = new_max
            xc = tl.load(cur_row + offs, mask=in_row, other=float("-inf"), eviction_policy=EV_CUR).to(tl.float32)
            g = _exp(xc - lse)
            g = tl.where(offs == target, g - 1.0, g) * scale
            tl.store(grad_row + offs, g.to(grad_ptr.dtype.element_ty), mask=in_row, cache_modifier=".cs")
        tl.store(row_loss_ptr + row, lse - tl.load(cur_row + target).to(tl.float32))
        row_max = tl.max(lane_max, axis=0)
        lse = _finite(row_max) + tl.log(tl.sum(lane_sum * _exp(lane_max - _finite(row_max)), axis=0))


def skew(logits, target, programs, chunk, warps, ev_next="evict_last", ev_cur="evict_first"):
    n_rows, n_vocab = logits.shape
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits)
    _skew_kernel[(min(programs, n_rows),)](logits, logits.stride(0), target, row_loss, grad, n_rows, n_vocab,
                                           1.0 / n_rows, CHUNK=chunk, LANE=8, EV_NEXT=ev_next, EV_CUR=ev_cur,
                                           num_warps=warps)
    return row_loss, grad


def main():
    torch.manual_seed(0)
    sms = sm_count(torch.device("cuda"))
    V = 128256
    configs = [(p, c, w, en, ec) for p in (sms // 2, 3 * sms // 4, sms) for c, w in ((16384, 32), (8192, 16))
               for en, ec in (("evict_last", "evict_first"),)]
    configs += [(sms, 16384, 32, "", ""), (3 * sms // 4, 16384, 32, "", ""), (sms, 32768, 32, "evict_last", "evict_first"),
                (2 * sms, 8192, 16, "evict_last", "evict_first")]
    for rows in (8192, 1024):
        logits = torch.randn(rows, V, device="cuda", dtype=torch.bfloat16) * 3
        target = torch.randint(0, V, (rows,), device="cuda")
        ref = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")
        lf = logits.float().requires_grad_()
        torch.nn.functional.cross_entropy(lf, target).backward()
        nbytes = 2 * logits.numel() * 2
        t = bench(lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, True), host_ahead=True).median_us
        print(f"rows {rows} main: {t:.1f} us {nbytes / t / 1e3:.0f} GB/s", flush=True)
        t = bench(lambda: logits.clone(), host_ahead=True).median_us
        print(f"rows {rows} clone: {t:.1f} us {nbytes / t / 1e3:.0f} GB/s", flush=True)
        for cfg in configs:
            loss, grad = skew(logits, target, *cfg)
            torch.cuda.synchronize()
            el = (loss - ref).abs().max().item()
            eg = (grad.float() - lf.grad).abs().max().item()
            t = bench(lambda: skew(logits, target, *cfg), host_ahead=True).median_us
            print(f"rows {rows} skew {cfg}: {t:.1f} us {nbytes / t / 1e3:.0f} GB/s loss err {el:.1e} grad err {eg:.1e}", flush=True)
        t = bench(lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, True), host_ahead=True).median_us
        print(f"rows {rows} main again: {t:.1f} us {nbytes / t / 1e3:.0f} GB/s", flush=True)
        del logits, lf


if __name__ == "__main__":
    main()
