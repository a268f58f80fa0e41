"""64-row projection GEMMs of Llama-3-8B: layouts and BLAS libraries, weights rotated past L2."""
import json, sys, torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
BW = 4.24e12
res = []

def timeit(fn, reps=20):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn(); torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    ts.sort(); return ts[len(ts) // 2]

for rows in (64, 16, 1):
    for name, (n, k) in SHAPES.items():
        size = n * k * 2
        copies = max(2, -(-400_000_000 // size))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        variants = {
            "linear": lambda: [F.linear(x, w) for w in ws],
            "x@Wt(KxN)": lambda: [x @ wt for wt in wts],
            "W@xT": lambda: [w @ x.t() for w in ws],
        }
        for lib in ("cublaslt", "cublas"):
            torch.backends.cuda.preferred_blas_library(lib)
            for vname, fn in variants.items():
                try:
                    us = timeit(fn) / copies
                except Exception as e:
                    print(name, rows, lib, vname, "failed", e); continue
                out = {"linear": lambda: F.linear(x, ws[0]), "x@Wt(KxN)": lambda: x @ wts[0], "W@xT": lambda: (ws[0] @ x.t()).t()}[vname]().float()
                err = (out - ref).abs().max().item()
                r = dict(proj=name, rows=rows, lib=lib, variant=vname, us=us, roofline_us=size / BW * 1e6,
                         pct=size / BW * 1e6 / us * 100, max_err=err)
                res.append(r)
                print(f"{name:8s} rows {rows:3d} {lib:9s} {vname:10s} {us:8.2f} us  {r['pct']:5.1f}% of roofline  err {err:.3g}", flush=True)
        del ws, wts
        torch.cuda.empty_cache()
json.dump(res, open(sys.argv[1], "w"), indent=1)
