"""What a grid-wide barrier inside one persistent kernel costs against a kernel boundary under dependent launch.

A decode layer's four projections as a chain of one-row GEMVs (each reads the one before's output), over every
layer of a model shape, timed in a CUDA graph:
- `kernels`: one launch of the engine's GEMV per projection, dependent launch on (as the engine runs them);
- `persistent`: one kernel for the whole chain, its programs resident, a grid barrier between projections;
- `persistent+pre`: the same, each program loading its first tile of the next projection's W before the barrier;
- `no-barrier`: the persistent kernel with the barriers left out (wrong results: the streaming bound);
- `copy`: one read of every W at the copy rate (torch's copy of the same bytes).
Usage: chain.py PRESET [PROGRAMS_PER_SM ...]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from fuselab.kernels._common.launch import dependent_launches, sm_count
from fuselab.kernels.linear import gemv_launch
from fuselab.timing import bench

SHAPES = {  # (hidden, q+k+v out, intermediate, layers)
    "tiny": (64, 96, 128, 2),
    "llama3-1b": (2048, 3072, 8192, 16),
    "llama3-8b": (4096, 6144, 14336, 32),
}
SPIN_LIMIT = tl.constexpr(1 << 24)


@triton.jit
def _chain_kernel(W, BUF, W_OFF, IN_OFF, OUT_OFF, NS, KS, COUNTER, ERR, n_stages,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BARRIER: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    rn = tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # The first tile of stage 0 for this program (rows pid*BLOCK_N...).
    n0 = tl.load(NS)
    k0_ = tl.load(KS)
    rows0 = pid * BLOCK_N + rn
    w_pre = tl.load(W + tl.load(W_OFF) + rows0[:, None].to(tl.int64) * k0_ + ks[None, :],
                    mask=(rows0 < n0)[:, None], other=0.0)
    for s in range(n_stages):
        n = tl.load(NS + s)
        k = tl.load(KS + s)
        w_base = W + tl.load(W_OFF + s)
        x_base = BUF + tl.load(IN_OFF + s)
        y_base = BUF + tl.load(OUT_OFF + s)
        for b in range(pid, tl.cdiv(n, BLOCK_N), progs):
            rows = b * BLOCK_N + rn
            row_ok = rows < n
            w_ptrs = w_base + rows[:, None].to(tl.int64) * k + ks[None, :]
            if PREFETCH:
                first = b == pid
                w = tl.load(w_ptrs, mask=(row_ok & (rows != pid * BLOCK_N + rn))[:, None], other=0.0)  # b != pid
                w = tl.where(first, w_pre, w)
            else:
                w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0)
            x = tl.load(x_base + ks, cache_modifier=".cg")
            acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
            for kk in range(BLOCK_K, k, BLOCK_K):
                w = tl.load(w_ptrs + kk, mask=row_ok[:, None], other=0.0)
                x = tl.load(x_base + kk + ks, cache_modifier=".cg")
                acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            tl.store(y_base + rows, tl.sum(acc, axis=1).to(BUF.dtype.element_ty), mask=row_ok)
        if PREFETCH:  # the next stage's first tile: W does not depend on this stage
            n_next = tl.load(NS + s + 1)
            rows_next = pid * BLOCK_N + rn
            w_pre = tl.load(W + tl.load(W_OFF + s + 1) + rows_next[:, None].to(tl.int64) * tl.load(KS + s + 1)
                            + ks[None, :], mask=(rows_next < n_next)[:, None], other=0.0)
        if BARRIER:
            tl.debug_barrier()  # every thread's stores before the release below
            tl.atomic_add(COUNTER, 1, sem="release", scope="gpu")
            target = (s + 1) * progs
            spins = 0
            seen = tl.load(COUNTER, volatile=True)
            while (seen < target) & (spins < SPIN_LIMIT):
                seen = tl.load(COUNTER, volatile=True)
                spins += 1
            tl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")  # orders the reads of the stage's input after
            if spins >= SPIN_LIMIT:
                tl.atomic_add(ERR, 1)


def build(preset: str, device: str = "cuda", dtype=torch.bfloat16):
    hidden, qkv, inter, layers = SHAPES[preset]
    stage_shapes = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * layers
    flat = torch.empty(sum(n * k for n, k in stage_shapes), device=device, dtype=dtype)
    ws, o = [], 0
    for n, k in stage_shapes:  # views of one buffer, which the persistent kernel reads whole
        ws.append(flat[o:o + n * k].view(n, k))
        ws[-1].normal_(std=k**-0.5)
        o += n * k
    return stage_shapes, ws, flat


class Persistent:
    def __init__(self, stage_shapes, ws, flat, x0, programs, block_n, block_k, barrier, prefetch):
        device = x0.device
        self.w = flat
        w_off = [w.data_ptr() // w.element_size() - flat.data_ptr() // flat.element_size() for w in ws]
        # BUF: x0, then each stage's output.
        out_off, b = [], max(n for n, _ in stage_shapes)
        for n, _ in stage_shapes:
            out_off.append(b)
            b += n
        in_off = [0] + out_off[:-1]
        self.buf = torch.zeros(b, device=device, dtype=x0.dtype)
        self.buf[: x0.numel()] = x0
        t = lambda v: torch.tensor(v + [0], device=device, dtype=torch.int64)  # one extra: the prefetch past the end
        self.w_off, self.in_off, self.out_off = t(w_off), t(in_off), t(out_off)
        self.ns = t([n for n, _ in stage_shapes])
        self.ks = t([k for _, k in stage_shapes])
        self.counter = torch.zeros(1, device=device, dtype=torch.int32)
        self.err = torch.zeros(1, device=device, dtype=torch.int32)
        self.n_stages = len(stage_shapes)
        self.grid = (programs,)
        self.meta = dict(BLOCK_N=block_n, BLOCK_K=block_k, BARRIER=barrier, PREFETCH=prefetch, num_warps=4,
                         num_stages=1)
        self.last = out_off[-1], stage_shapes[-1][0]

    def __call__(self):
        self.counter.zero_()
        _chain_kernel[self.grid](self.w, self.buf, self.w_off, self.in_off, self.out_off, self.ns, self.ks,
                                 self.counter, self.err, self.n_stages, **self.meta)

    def output(self):
        o, n = self.last
        return self.buf[o:o + n]


def kernels_chain(stage_shapes, ws, x0):
    def run():
        x = x0
        with dependent_launches():
            for (n, k), w in zip(stage_shapes, ws):
                x = gemv_launch(x[:k], w, None)  # a 1-D slice: contiguous, no copy
        return x
    return run


def main() -> None:
    preset = sys.argv[1]
    per_sm = [int(a) for a in sys.argv[2:]] or [1, 2]
    torch.manual_seed(0)
    stage_shapes, ws, flat = build(preset)
    hidden = stage_shapes[0][1]
    x0 = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    weight_bytes = sum(w.numel() * w.element_size() for w in ws)
    layers = SHAPES[preset][3]
    sms = sm_count(torch.device("cuda"))
    rows = []

    def record(name, fn, out=None):
        r = bench(fn, cuda_graph=True, rep_ms=300)
        row = dict(variant=name, us=round(r.median_us, 1), us_per_layer=round(r.median_us / layers, 2),
                   tb_s=round(weight_bytes / r.median_us / 1e6, 3))
        if out is not None:
            row["max_err_vs_kernels_rel_to_max"] = out
        rows.append(row)
        print(json.dumps(row), flush=True)

    ref_fn = kernels_chain(stage_shapes, ws, x0)
    ref = ref_fn().float()
    record("kernels (engine GEMV, dependent launch)", ref_fn)
    # Both chains read the first k of the stage before's output (the q/k/v and gate/up outputs are longer).
    for p in per_sm:
        for block_n, block_k in ((2, 2048), (4, 1024)):
            for barrier, prefetch, name in ((True, False, "persistent"), (True, True, "persistent+pre"),
                                            (False, False, "no-barrier")):
                chain = Persistent(stage_shapes, ws, flat, x0, p * sms, block_n, block_k, barrier, prefetch)
                chain()
                torch.cuda.synchronize()
                err = ((chain.output().float() - ref).abs().max() / ref.abs().max()).item() if barrier else None
                if chain.err.item():
                    print(f"{name} p={p} spin limit hit: programs not all resident", flush=True)
                    continue
                record(f"{name} {p}/SM, tile {block_n}x{block_k}", chain, err)
    half = flat.numel() // 2  # a copy of half of W (overwrites W, so last): each byte read once or written once
    record("copy (half of W to the other half)", lambda: flat[half:2 * half].copy_(flat[:half]))
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, f"chain-{preset}.json"), "w") as f:
        json.dump(dict(preset=preset, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, weight_bytes=weight_bytes, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
