import importlib, json, sys, os
import torch, triton
sys.path.insert(0, os.path.dirname(__file__))
import bwd_variants as bv
from fuselab.device import ceilings
from fuselab.timing import bench

rope = importlib.import_module("fuselab.kernels.rope")
dev = "cuda" if torch.cuda.is_available() else "cpu"
copy = ceilings().copy_bandwidth_gbs if dev == "cuda" else 1.0


def pct(nbytes, us):
    return 100 * nbytes / us / 1e3 / copy


def time(fn):
    if dev == "cpu":
        fn()
        return float("nan")
    return bench(fn).median_us


out = []
rows, cols = (16384, 8192) if dev == "cuda" else (7, 40)
x, dy = (torch.randn(rows, cols, device=dev, dtype=torch.bfloat16) for _ in range(2))
w = torch.randn(cols, device=dev, dtype=torch.bfloat16)
rstd = torch.rand(rows, device=dev, dtype=torch.float32) + 0.5
xh = x.float() * rstd[:, None]
ref_dx = (dy.float() * w.float() - xh * (dy.float() * w.float() * xh).mean(-1, keepdim=True)) * rstd[:, None]
ref_dw = (dy.float() * xh).sum(0)
sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 2
block = triton.next_power_of_2(cols)
for name, kern in (("stages", bv.rms_bwd_stages), ("prefetch", bv.rms_bwd_prefetch), ("rows2", bv.rms_bwd_rows2)):
    for per_sm in (1, 2):
        for warps in (8, 16, 32):
            for stages in ((1, 2, 3) if name == "stages" else (1,)):
                programs = min(rows, sms * per_sm)
                rpp = triton.cdiv(rows, programs)
                if name == "rows2":
                    rpp += rpp % 2
                programs = triton.cdiv(rows, rpp)
                partial = torch.zeros(programs, cols, device=dev, dtype=torch.float32)
                dx = torch.empty_like(x)
                f = lambda: kern[(programs,)](dy, x, w, rstd, dx, partial, rows, cols, rpp, BLOCK=block, STAGES=stages,
                                              num_warps=warps)
                try:
                    f()
                    err = max((dx.float() - ref_dx).abs().max().item(), (partial.sum(0) - ref_dw).abs().max().item() / 100)
                    us = time(f)
                    r = {"kernel": f"rms bwd {name}", "per_sm": per_sm, "warps": warps, "stages": stages, "us": us,
                         "pct": pct(3 * x.nbytes, us), "err": err}
                    if dev == "cuda":
                        ck = f()
                        r["async_copy"] = "async_copy" in getattr(ck, "asm", {}).get("ttgir", "")
                except Exception as e:  # noqa: BLE001
                    r = {"kernel": f"rms bwd {name}", "per_sm": per_sm, "warps": warps, "stages": stages, "error": repr(e)[:300]}
                print(r, flush=True)
                out.append(r)
for warps in (4, 8, 16, 32):
    dx = torch.empty_like(x)
    f = lambda: bv.rms_bwd_row[(rows,)](dy, x, w, rstd, dx, x, rows, cols, 1, BLOCK=block, STAGES=1, num_warps=warps)
    f()
    r = {"kernel": "rms bwd dx only, row programs", "warps": warps, "us": time(f), "err": (dx.float() - ref_dx).abs().max().item()}
    r["pct"] = pct(3 * x.nbytes, r["us"])
    print(r, flush=True)
    out.append(r)


mean = x.float().mean(-1)
ln_rstd = torch.rsqrt(x.float().var(-1, unbiased=False) + 1e-5)
xh = (x.float() - mean[:, None]) * ln_rstd[:, None]
dzw = dy.float() * w.float()
ref_dx = (dzw - dzw.mean(-1, keepdim=True) - xh * (dzw * xh).mean(-1, keepdim=True)) * ln_rstd[:, None]
ln = importlib.import_module("fuselab.kernels.layer_norm")
for name in ("current", "prefetch"):
    for per_sm in (1, 2):
        for warps in (8, 16, 32):
            programs = min(rows, sms * per_sm)
            rpp = triton.cdiv(rows, programs)
            programs = triton.cdiv(rows, rpp)
            dwp, dbp = (torch.zeros(programs, cols, device=dev, dtype=torch.float32) for _ in range(2))
            dx = torch.empty_like(x)
            if name == "current":
                f = lambda: ln._layer_norm_backward_kernel[(programs,)](
                    dy, x, w, w, mean, ln_rstd, dy, dx, dwp, dbp, rows, cols, rpp,
                    HAS_BIAS=True, HAS_DH=False, ACTIVATION="none", BLOCK=block, num_warps=warps)
            else:
                f = lambda: bv.ln_bwd_prefetch[(programs,)](dy, x, w, mean, ln_rstd, dx, dwp, dbp, rows, cols, rpp,
                                                            BLOCK=block, STAGES=1, num_warps=warps)
            f()
            err = max((dx.float() - ref_dx).abs().max().item(), (dbp.sum(0) - dy.float().sum(0)).abs().max().item() / 100)
            us = time(f)
            r = {"kernel": f"ln bwd {name}", "per_sm": per_sm, "warps": warps, "us": us, "pct": pct(3 * x.nbytes, us), "err": err}
            print(r, flush=True)
            out.append(r)

# rope forward at 16384 tokens x (32 + 8) heads x 128: num_warps and head tiles
tokens = 16384 if dev == "cuda" else 5
q = torch.randn(tokens, 32, 128, device=dev, dtype=torch.bfloat16)
k = torch.randn(tokens, 8, 128, device=dev, dtype=torch.bfloat16)
pos = torch.randint(0, 8192, (tokens,), device=dev)
from fuselab.kernels import rope_cos_sin
cs = rope_cos_sin(8192, 128, base=500000.0, device=dev)
nbytes = 2 * (q.nbytes + k.nbytes) + tokens * (8 + 128 * cs.itemsize)
for warps in (1, 2, 4, 8, 16):
    for qh in (8, 16, 32):
        meta = dict(rope._rope_meta(128, 128, 32, 8, False, False, None, None, False))
        meta["BLOCK_Q_HEADS"] = qh
        qo, ko = torch.empty_like(q), torch.empty_like(k)
        f = lambda: rope._rope_kernel[(tokens,)](
            q, *rope._token_strides(q), k, *rope._token_strides(k), qo, *rope._token_strides(qo),
            ko, *rope._token_strides(ko), pos, *rope._positions_strides(pos), cs, cs.stride(0), cs.shape[0],
            tokens, 32, 8, *rope._NO_STORE, **meta, USE_PDL=False, num_warps=warps)
        f()
        us = time(f)
        r = {"kernel": "rope fwd", "warps": warps, "q_heads_tile": qh, "us": us, "pct": pct(nbytes, us)}
        print(r, flush=True)
        out.append(r)
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
