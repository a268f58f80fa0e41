import importlib, json, sys, os
import torch, triton
sys.path.insert(0, os.path.dirname(__file__))
import bwd_variants as bv
from fuselab.device import ceilings
from fuselab.timing import bench

rn, ln, rope, ba = (importlib.import_module(f"fuselab.kernels.{m}") for m in ("rms_norm", "layer_norm", "rope", "bias_act"))
dev = "cuda" if torch.cuda.is_available() else "cpu"
copy = ceilings().copy_bandwidth_gbs if dev == "cuda" else 1.0
pct = lambda nbytes, us: 100 * nbytes / us / 1e3 / copy
out = []


def rec(r):
    print(r, flush=True)
    out.append(r)


def time(f):
    f()
    return bench(f).median_us if dev == "cuda" else float("nan")


rows, cols = (16384, 8192) if dev == "cuda" else (7, 40)
block = triton.next_power_of_2(cols)
sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 2
x, dy, dh = (torch.randn(rows, cols, device=dev, dtype=torch.bfloat16) for _ in range(3))
w = torch.randn(cols, device=dev, dtype=torch.bfloat16)
rstd = torch.rand(rows, device=dev, dtype=torch.float32) + 0.5
mean = torch.randn(rows, device=dev, dtype=torch.float32)
dx = torch.empty_like(x)
for warps in (8, 16, 32):
    for per_sm in (1, 2):
        programs = min(rows, sms * per_sm)
        rpp = triton.cdiv(rows, programs)
        programs = triton.cdiv(rows, rpp)
        part, part2 = (torch.empty(programs, cols, device=dev, dtype=torch.float32) for _ in range(2))
        for stages in (1, 3, 4):
            for has_dh in ((False, True) if stages == 3 and per_sm == 1 else (False,)):
                f = lambda: rn._rms_norm_backward_kernel[(programs,)](
                    dy, x, w, rstd, dh, dx, part, rows, cols, rpp, HAS_DH=has_dh, BLOCK=block, STAGES=stages, num_warps=warps)
                us = time(f)
                rec({"kernel": "rms bwd" + (" +dh" if has_dh else ""), "warps": warps, "per_sm": per_sm, "stages": stages,
                     "us": us, "pct": pct((4 if has_dh else 3) * x.nbytes, us)})
            for act in (("none", "gelu") if stages == 3 and per_sm == 1 else ("none",)):
                f = lambda: ln._layer_norm_backward_kernel[(programs,)](
                    dy, x, w, w, mean, rstd, dy, dx, part, part2, rows, cols, rpp,
                    HAS_BIAS=True, HAS_DH=False, ACTIVATION=act, BLOCK=block, STAGES=stages, num_warps=warps)
                us = time(f)
                rec({"kernel": f"ln bwd act={act}", "warps": warps, "per_sm": per_sm, "stages": stages, "us": us,
                     "pct": pct(3 * x.nbytes, us)})
# rms forward, persistent programs with a staged loop
y = torch.empty_like(x)
for warps in (4, 8, 16):
    for per_sm in (1, 2, 4):
        programs = min(rows, sms * per_sm)
        rpp = triton.cdiv(rows, programs)
        programs = triton.cdiv(rows, rpp)
        for stages in (1, 3, 4):
            f = lambda: bv.rms_fwd_persistent[(programs,)](x, w, y, rows, cols, 1e-6, rpp, BLOCK=block, STAGES=stages,
                                                           num_warps=warps)
            try:
                us = time(f)
                rec({"kernel": "rms fwd persistent", "warps": warps, "per_sm": per_sm, "stages": stages, "us": us,
                     "pct": pct(2 * x.nbytes, us)})
            except Exception as e:
                rec({"kernel": "rms fwd persistent", "warps": warps, "per_sm": per_sm, "stages": stages, "error": repr(e)[:200]})
# bias_act backward (exact GELU) with a staged band loop
for blk in (1024, 2048):
    for band_rows in (16, 32):
        bands = triton.cdiv(rows, band_rows)
        part = torch.empty(bands, cols, device=dev, dtype=torch.float32)
        for stages in (1, 2, 3, 4):
            f = lambda: bv.bias_act_bwd_stages[(bands * triton.cdiv(cols, blk),)](
                dy, x, w, dx, part, rows, cols, ACTIVATION="gelu", BLOCK=blk, ROWS=band_rows, STAGES=stages, num_warps=4)
            us = time(f)
            rec({"kernel": "bias_act bwd gelu", "block": blk, "rows": band_rows, "stages": stages, "us": us,
                 "pct": pct(3 * x.nbytes, us)})
# rope forward: q-head tile by token count
from fuselab.kernels import rope_cos_sin
cs = rope_cos_sin(8192, 128, base=500000.0, device=dev)
for tokens in ((1024, 4096, 16384) if dev == "cuda" else (5,)):
    q = torch.randn(tokens, 32, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(tokens, 8, 128, device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (tokens,), device=dev)
    nbytes = 2 * (q.nbytes + k.nbytes) + tokens * (8 + 128 * cs.itemsize)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    for warps in (2, 4):
        for qh, kh in ((8, 8), (16, 8), (32, 8), (4, 4)):
            meta = dict(rope._rope_meta(128, 128, 32, 8, False, False, None, None, False))
            meta["BLOCK_Q_HEADS"], meta["BLOCK_K_HEADS"] = qh, kh
            f = lambda: rope._rope_kernel[(tokens,)](
                q, *rope._token_strides(q), k, *rope._token_strides(k), qo, *rope._token_strides(qo),
                ko, *rope._token_strides(ko), pos, *rope._positions_strides(pos), cs, cs.stride(0), cs.shape[0],
                tokens, 32, 8, *rope._NO_STORE, **meta, USE_PDL=False, num_warps=warps)
            us = time(f)
            rec({"kernel": "rope fwd", "tokens": tokens, "warps": warps, "q_tile": qh, "k_tile": kh, "us": us,
                 "pct": pct(nbytes, us)})
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
