"""Cross-entropy loss + gradient with each row held in registers, spread over PARTS programs on
different SMs that exchange their partial log-sum-exps through global memory (one read, one write).

    PYTHONPATH=. python3 benchmarks/results/2026-11-30-h200/ce-coop/ce_coop.py RUN     (RUN 1-4: ce_coop-RUN.txt)

Every program of a launch must be resident at once (they wait on each other): the script compiles each
config first and skips it when the grid would exceed what the GPU holds."""
import importlib
import sys

import torch
import triton
import triton.language as tl

from fuselab.kernels._launch import sm_count, resident_programs
from fuselab.timing import bench

ce = importlib.import_module("fuselab.kernels.cross_entropy")
_exp, _finite = ce._exp, ce._finite


@triton.jit
def _coop_kernel(logits_ptr, stride, target_ptr, row_loss_ptr, grad_ptr, part_ptr, count_ptr,
                 n_rows, n_vocab, scale, PART: tl.constexpr, PARTS: tl.constexpr, CG: tl.constexpr,
                 RAW: tl.constexpr = False, FIXUP: tl.constexpr = False, PF: tl.constexpr = False):
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // PARTS
    part = pid % PARTS
    cols = part * PART + tl.arange(0, PART)
    in_row = cols < n_vocab
    first = pid // PARTS
    if PF:
        x_next = tl.load(logits_ptr + tl.cast(first, tl.int64) * stride + cols, mask=in_row & (first < n_rows),
                         other=float("-inf"))
    for row in range(first, n_rows, groups):
        row = tl.cast(row, tl.int64)
        base = logits_ptr + row * stride
        target = tl.load(target_ptr + row).to(tl.int64)
        if PF:
            x_raw = x_next
            nxt = row + groups
            x_next = tl.load(logits_ptr + nxt * stride + cols, mask=in_row & (nxt < n_rows), other=float("-inf"))
        else:
            x_raw = tl.load(base + cols, mask=in_row, other=float("-inf"))
        x = x_raw.to(tl.float32)
        m = tl.max(x, axis=0)
        s = tl.sum(_exp(x - _finite(m)), axis=0)
        if PARTS > 1:
            slot = part_ptr + row * 2 * PARTS
            tl.store(slot + part, m)
            tl.store(slot + PARTS + part, s)
            tl.debug_barrier()
            tl.atomic_add(count_ptr + row, 1, sem="release")
            seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
            while seen < PARTS:
                seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
            tl.debug_barrier()
            ps = tl.arange(0, PARTS)
            if CG:
                pm = tl.load(slot + ps, cache_modifier=".cg")
                pss = tl.load(slot + PARTS + ps, cache_modifier=".cg")
            else:
                pm = tl.load(slot + ps, volatile=True)
                pss = tl.load(slot + PARTS + ps, volatile=True)
            m = tl.max(pm, axis=0)
            s = tl.sum(pss * _exp(pm - _finite(m)), axis=0)
        lse = _finite(m) + tl.log(s)
        if part == 0:
            tl.store(row_loss_ptr + row, lse - tl.load(base + target).to(tl.float32))
        if RAW:
            x = x_raw.to(tl.float32)
        g = _exp(x - lse)
        if FIXUP:
            g = g * scale
        else:
            g = tl.where(cols == target, g - 1.0, g) * scale
        tl.store(grad_ptr + row * stride + cols, g.to(grad_ptr.dtype.element_ty), mask=in_row, cache_modifier=".cs")
        if FIXUP:
            if (target >= part * PART) & (target < part * PART + PART):
                tl.debug_barrier()
                xt = tl.load(base + target).to(tl.float32)
                tl.store(grad_ptr + row * stride + target, ((_exp(xt - lse) - 1.0) * scale).to(grad_ptr.dtype.element_ty))


@triton.jit
def _publish(part_ptr, count_ptr, row, part, m, s, PARTS: tl.constexpr):
    slot = part_ptr + row * 2 * PARTS
    tl.store(slot + part, m)
    tl.store(slot + PARTS + part, s)
    tl.debug_barrier()
    tl.atomic_add(count_ptr + row, 1, sem="release")


@triton.jit
def _nap(x, NS: tl.constexpr):
    return tl.inline_asm_elementwise(f"nanosleep.u32 {NS}; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _gather_lse(part_ptr, count_ptr, row, PARTS: tl.constexpr, SPIN: tl.constexpr = 0):
    if SPIN == 0:
        seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
        while seen < PARTS:
            seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
    elif SPIN == 1:
        seen = tl.load(count_ptr + row, volatile=True)
        while seen < PARTS:
            seen = tl.load(count_ptr + row, volatile=True)
        seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
    else:
        seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
        while seen < PARTS:
            seen = _nap(tl.atomic_add(count_ptr + row, 0, sem="acquire"), SPIN)
    tl.debug_barrier()
    slot = part_ptr + row * 2 * PARTS
    ps = tl.arange(0, PARTS)
    pm = tl.load(slot + ps, cache_modifier=".cg")
    pss = tl.load(slot + PARTS + ps, cache_modifier=".cg")
    m = tl.max(pm, axis=0)
    return _finite(m) + tl.log(tl.sum(pss * _exp(pm - _finite(m)), axis=0))


@triton.jit
def _pipe_kernel(logits_ptr, stride, target_ptr, row_loss_ptr, grad_ptr, part_ptr, count_ptr,
                 n_rows, n_vocab, scale, PART: tl.constexpr, PARTS: tl.constexpr, SPIN: tl.constexpr):
    """Software-pipelined: row i+1 is loaded and its partial published before waiting on row i's."""
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // PARTS
    part = pid % PARTS
    cols = part * PART + tl.arange(0, PART)
    in_row = cols < n_vocab
    first = pid // PARTS
    x = tl.load(logits_ptr + tl.cast(first, tl.int64) * stride + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    _publish(part_ptr, count_ptr, first, part, m, tl.sum(_exp(x - _finite(m)), axis=0), PARTS)
    for row in range(first, n_rows, groups):
        row = tl.cast(row, tl.int64)
        nxt = row + groups
        x_next = tl.load(logits_ptr + nxt * stride + cols, mask=in_row & (nxt < n_rows), other=float("-inf")).to(tl.float32)
        m = tl.max(x_next, axis=0)
        s = tl.sum(_exp(x_next - _finite(m)), axis=0)
        if nxt < n_rows:
            _publish(part_ptr, count_ptr, nxt, part, m, s, PARTS)
        lse = _gather_lse(part_ptr, count_ptr, row, PARTS, SPIN)
        base = logits_ptr + row * stride
        target = tl.load(target_ptr + row).to(tl.int64)
        if part == 0:
            tl.store(row_loss_ptr + row, lse - tl.load(base + target).to(tl.float32))
        g = _exp(x - lse) * scale
        tl.store(grad_ptr + row * stride + cols, g.to(grad_ptr.dtype.element_ty), mask=in_row, cache_modifier=".cs")
        if (target >= part * PART) & (target < part * PART + PART):
            tl.debug_barrier()
            xt = tl.load(base + target).to(tl.float32)
            tl.store(grad_ptr + row * stride + target, ((_exp(xt - lse) - 1.0) * scale).to(grad_ptr.dtype.element_ty))
        x = x_next


_cap = {}
# Per run (ce_coop-RUN.txt): the rows, the `coop` configs (part, warps, programs an SM, maxnreg, target
# fixed up by one scalar store, cooperative launch, next row prefetched) and the `pipe` configs (part,
# warps, programs an SM, maxnreg, spin: 0 acquire loads, 1 volatile loads, N nanosleep N between polls).
_FIRST = [(16384, 16, 2, 64, True, False, False), (16384, 16, 2, 64, True, True, False),
          (16384, 16, 2, 64, False, False, False), (8192, 8, 4, 64, True, False, False),
          (8192, 16, 2, None, True, False, False), (32768, 32, 1, None, True, False, False),
          (4096, 8, 4, None, False, False, False), (4096, 4, 8, None, True, False, False),
          (8192, 8, 3, None, True, False, False)]
_PREFETCH = [(8192, 8, 4, 64, True, False, False), (8192, 16, 2, 64, True, False, True),
             (4096, 8, 4, 64, True, False, True), (16384, 32, 1, None, True, False, True),
             (8192, 16, 1, None, True, False, True), (4096, 8, 3, 80, True, False, True)]
RUNS = {
    1: ((8192, 1024, 264, 132), _FIRST, []),
    2: ((8192, 1024, 264, 132), _PREFETCH, []),
    3: ((8192, 1024), _PREFETCH[:1], [(8192, 16, 2, 64, 0), (4096, 8, 4, 64, 0), (16384, 32, 1, None, 0),
                                       (8192, 8, 2, 128, 0), (4096, 4, 4, 128, 0), (4096, 4, 8, 64, 0)]),
    4: ((8192, 1024), _PREFETCH[:1], [(p, w, n, r, sp) for p, w, n, r in ((4096, 8, 4, 64), (8192, 16, 2, 64))
                                      for sp in (0, 1, 100, 500)]),
}


def coop(logits, target, part, warps, per_sm, maxnreg=None, fixup=True, coop_launch=False, pf=False, cg=True):
    n_rows, n_vocab = logits.shape
    parts = triton.cdiv(n_vocab, part)
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits)
    partials = torch.empty(n_rows * 2 * parts, dtype=torch.float32, device=logits.device)
    count = torch.zeros(n_rows, dtype=torch.int32, device=logits.device)
    args = (logits, logits.stride(0), target, row_loss, grad, partials, count, n_rows, n_vocab, 1.0 / n_rows)
    kw = dict(PART=part, PARTS=parts, CG=cg, FIXUP=fixup, PF=pf, num_warps=warps)
    if maxnreg:
        kw["maxnreg"] = maxnreg
    if coop_launch:
        kw["launch_cooperative_grid"] = True
    key = (part, warps, cg, n_vocab, maxnreg, fixup, coop_launch, pf)
    if key not in _cap:
        c = _coop_kernel.warmup(*args, grid=(1,), **kw)
        _cap[key] = resident_programs(c, logits.device)
        print(f"  part {part} warps {warps}: regs {c.n_regs} spills {c.n_spills} resident {_cap[key]}", flush=True)
    groups = min(n_rows, per_sm * sm_count(logits.device) // parts)
    if groups * parts > _cap[key]:
        return None
    _coop_kernel[(groups * parts,)](*args, **kw)
    return row_loss, grad


def pipe(logits, target, part, warps, per_sm, maxnreg=None, spin=0):
    n_rows, n_vocab = logits.shape
    parts = triton.cdiv(n_vocab, part)
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits)
    partials = torch.empty(n_rows * 2 * parts, dtype=torch.float32, device=logits.device)
    count = torch.zeros(n_rows, dtype=torch.int32, device=logits.device)
    args = (logits, logits.stride(0), target, row_loss, grad, partials, count, n_rows, n_vocab, 1.0 / n_rows)
    kw = dict(PART=part, PARTS=parts, SPIN=spin, num_warps=warps)
    if maxnreg:
        kw["maxnreg"] = maxnreg
    key = ("pipe", part, warps, n_vocab, maxnreg, spin)
    if key not in _cap:
        c = _pipe_kernel.warmup(*args, grid=(1,), **kw)
        _cap[key] = resident_programs(c, logits.device)
        print(f"  pipe part {part} warps {warps}: regs {c.n_regs} spills {c.n_spills} resident {_cap[key]}", flush=True)
        try:
            import collections, re
            sass = c.asm["sass"]
            print("   ", dict(collections.Counter(re.findall(r"(LDG[.A-Z0-9]*|STG[.A-Z0-9]*|NANOSLEEP)", sass))), flush=True)
        except Exception as e:
            print("    no sass:", e)
    groups = min(n_rows, per_sm * sm_count(logits.device) // parts)
    if groups * parts > _cap[key]:
        return None
    _pipe_kernel[(groups * parts,)](*args, **kw)
    return row_loss, grad


def main(run):
    rows_list, configs, pipes = RUNS[run]
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for rows in rows_list:
        V = 128256
        logits = torch.randn(rows, V, device=dev, dtype=torch.bfloat16) * 3
        target = torch.randint(0, V, (rows,), device=dev)
        ref = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")
        lf = logits.float().requires_grad_()
        torch.nn.functional.cross_entropy(lf, target).backward()
        nbytes = 2 * logits.numel() * 2
        base = lambda: ce._cross_entropy_forward(logits, target, -100, "mean", 0.0, True)
        t = bench(base, host_ahead=True).median_us
        print(f"rows {rows} main: {t:.1f} us {nbytes / t / 1e3:.0f} GB/s", flush=True)
        t = bench(lambda: logits.clone(), host_ahead=True).median_us
        print(f"rows {rows} clone (one read, one write): {t:.1f} us {nbytes / t / 1e3:.0f} GB/s", flush=True)
        for part, warps, per_sm, maxnreg, fixup, cl, pf in configs:
            name = f"part {part} warps {warps} per_sm {per_sm} maxnreg {maxnreg} fixup {fixup} coop {cl} pf {pf}"
            r = coop(logits, target, part, warps, per_sm, maxnreg, fixup, cl, pf)
            if r is None:
                print(f"rows {rows} {name}: not resident", flush=True)
                continue
            loss, grad = r
            torch.cuda.synchronize()
            err_l = (loss - ref).abs().max().item()
            err_g = (grad.float() - lf.grad).abs().max().item()
            t = bench(lambda: coop(logits, target, part, warps, per_sm, maxnreg, fixup, cl, pf), host_ahead=True).median_us
            print(f"rows {rows} {name}: {t:.1f} us "
                  f"{nbytes / t / 1e3:.0f} GB/s  loss err {err_l:.2e} grad err {err_g:.2e}", flush=True)
        for part, warps, per_sm, maxnreg, spin in pipes:
            name = f"pipe part {part} warps {warps} per_sm {per_sm} maxnreg {maxnreg} spin {spin}"
            r = pipe(logits, target, part, warps, per_sm, maxnreg, spin)
            if r is None:
                print(f"rows {rows} {name}: not resident", flush=True)
                continue
            loss, grad = r
            torch.cuda.synchronize()
            err_l = (loss - ref).abs().max().item()
            err_g = (grad.float() - lf.grad).abs().max().item()
            t = bench(lambda: pipe(logits, target, part, warps, per_sm, maxnreg, spin), host_ahead=True).median_us
            print(f"rows {rows} {name}: {t:.1f} us "
                  f"{nbytes / t / 1e3:.0f} GB/s  loss err {err_l:.2e} grad err {err_g:.2e}", flush=True)
        del logits, lf


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
