"""Run from the repository root with PYTHONPATH=. on a GPU. 8-bit weights at one row of x: the GEMV (engine today) against W8A8 and the W8A16 GEMM, in a CUDA graph
with dependent launches over distinct weight copies (from HBM). Prints a table and writes JSON."""
import importlib, json, sys, torch
from importlib.machinery import SourceFileLoader
tqg = SourceFileLoader("tqg", "scripts/tune-quant-gemv").load_module()
from fuselab.kernels import dependent_launches
ql = importlib.import_module("fuselab.kernels.quantized_linear")
qg = importlib.import_module("fuselab.kernels.quantized_gemm")
qw = importlib.import_module("fuselab.kernels.quantized_gemm_w8a8")
from fuselab.kernels._common.launch import sm_count

def time_us(launches):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with dependent_launches():
            for f in launches: f()
    torch.cuda.current_stream().wait_stream(s)
    with dependent_launches(), torch.cuda.graph(g):
        for f in launches: f()
    for _ in range(3): g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(launches))
    ts.sort()
    return ts[len(ts) // 2]

rows = []
sms = sm_count(torch.device("cuda"))
for fmt in ("int8", "fp8"):
    for shape, (n, k) in tqg.SHAPES.items():
        case = tqg.Case(fmt, shape, n, k, "cuda", timed=True)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        ref = case.reference(x)
        scale = ref.abs().max().item()
        kp = 4 * case.weight.data.shape[1]
        variants = [("gemv (engine)", lambda x, w, y: ql.quantized_linear(x, w, out=y))]
        variants.append(("w8a16 gemm rule", lambda x, w, y: qg.launch_gemm(x, w, None, y)))
        rule = qw.w8a8_config(1, n, kp, sms)
        cfgs = {rule}
        for bn in (64, 128, 256):
            for split in (1, 2, 4):
                for st in (3, 4):
                    cfgs.add((16, bn, 128, split, 4, st))
        for c in sorted(cfgs):
            variants.append((f"w8a8 {c}" + (" rule" if c == rule else ""),
                             lambda x, w, y, c=c: qw.launch_w8a8(x, w, None, y, config=c)))
        for name, f in variants:
            y.fill_(float("nan"))
            try:
                with dependent_launches():
                    f(x, case.weight, y)
                torch.cuda.synchronize()
                err = ((y.float() - ref).abs().max() / scale).item()
                us = time_us([lambda w=w: f(x, w, y) for w in case.weights]) if err < 0.08 else None
            except Exception as e:
                err, us = None, None
                name += f" ({type(e).__name__})"
            roof = case.weight.nbytes / 4.24e6
            rows.append(dict(fmt=fmt, shape=shape, variant=name, us=us, err=err, roofline_us=roof))
            print(f"{fmt:5s} {shape:8s} {name:40s} {us if us is None else round(us, 2)!s:>8s} us  err {err}  roof {roof:.1f}", flush=True)
        del case
        torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[1], "w"), indent=1)
# summary: best per (fmt, shape)
print("\nbest per case:")
for fmt in ("int8", "fp8"):
    for shape in tqg.SHAPES:
        rs = [r for r in rows if r["fmt"] == fmt and r["shape"] == shape and r["us"]]
        g = next(r for r in rs if r["variant"].startswith("gemv"))
        b = min(rs, key=lambda r: r["us"])
        print(f"{fmt:5s} {shape:8s} gemv {g['us']:.1f}  best {b['us']:.1f} {b['variant']}  roof {b['roofline_us']:.1f}")
