"""int4 at one row: the CUDA-core GEMV against the wide tensor-core kernel (configs x prefetch), 8B and 1B shapes."""
import importlib.machinery, importlib.util, json, sys, time, itertools, os
from concurrent.futures import ProcessPoolExecutor
import torch

sys.argv = [sys.argv[0]]
loader = importlib.machinery.SourceFileLoader("tqg", "scripts/tune-quant-gemv")
spec = importlib.util.spec_from_loader("tqg", loader); tqg = importlib.util.module_from_spec(spec); loader.exec_module(tqg)
from fuselab.kernels._common.launch import dependent_launches, cdiv
ql, qg = tqg.ql, tqg.qg

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096), "qkv": (6144, 4096),
          "o": (4096, 4096),
          "qkv1": (3072, 2048), "o1": (2048, 2048), "gate_up1": (16384, 2048), "down1": (2048, 8192),
          "lm_head1": (128256, 2048)}

def grid(n, n_words):
    out = []
    for bn, bw in [(64, 16), (64, 32), (64, 64), (128, 16), (128, 32), (128, 64), (256, 16), (256, 32)]:
        if n_words % bw:
            continue
        tiles = cdiv(n, bn)
        for split in (1, 2, 4, 8):
            if split > n_words // bw or (split > 1 and (tiles * split > 2 * 132 or tiles >= 2 * 132)):
                continue
            for warps in (4, 8):
                for stages in ((3, 4) if bw == 16 else (3,)):
                    if qg.gemm_shared_bytes(16, bn, bw, "int4", stages, 2, 2) > 220 * 1024:
                        continue
                    out.append((16, bn, bw, split, warps, stages, 2))
    return out

def compile_job(configs):
    torch.cuda.set_device(0)
    from fuselab.kernels import quantize_weight
    w = quantize_weight(torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16), "int4", 128)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, 512, device="cuda", dtype=torch.bfloat16)
    bad = []
    for c, pf in configs:
        qg.PREFETCH_STEPS = pf
        try:
            with dependent_launches():
                qg.launch_gemm(x, w, None, y, config=c)
        except Exception as e:
            bad.append((c, pf, str(e)[:200]))
    torch.cuda.synchronize()
    return bad

def main():
    out = os.environ["OUT"] + "/r"
    log = open(out + "/sweep1.log", "w")
    def p(*a):
        s = " ".join(map(str, a)); print(s, flush=True); log.write(s + "\n"); log.flush()
    allc = sorted({c for n, k in SHAPES.values() for c in grid(n, k // 8)})
    units = [(c, pf) for c in allc for pf in (0, 4)]
    t0 = time.time()
    jobs = [units[i::14] for i in range(14)]
    import multiprocessing as mp
    with ProcessPoolExecutor(14, mp_context=mp.get_context("spawn")) as ex:
        for bad in ex.map(compile_job, jobs):
            for b in bad: p("COMPILE FAIL", b)
    p(f"compiled {len(units)} units in {time.time()-t0:.0f} s")
    results = []
    for name, (n, k) in SHAPES.items():
        case = tqg.Case("int4", name, n, k, "cuda", True)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        ref = case.reference(x); scale = ref.abs().max().item()
        def timed(fn, pdl):
            y.fill_(float("nan")); fn(case.weight)
            err = ((y.float() - ref).abs().max() / scale).item()
            if not err <= 2e-2:
                return None, err
            def chain():
                for w in case.weights: fn(w)
            if pdl:
                def chain2():
                    with dependent_launches():
                        chain()
                us = tqg._time([chain2], False) / len(case.weights)
            else:
                us = tqg._time([chain], False) / len(case.weights)
            return us, err
        nbytes = case.weight.nbytes
        row = {"shape": name, "n": n, "k": k, "bytes": nbytes}
        bf = tqg._time([lambda w=w: torch.matmul(x, w.t(), out=y) for w in case.dense], False)
        row["bf16"] = bf
        for pdl in (False, True):
            us, err = timed(lambda w: ql._launch_gemv(x, w, None, y), pdl)
            row[f"gemv pdl={pdl}"] = us
        rule = qg.gemm_config(1, n, k // 8, "int4", 132)
        row["rule"] = str(rule)
        res = {}
        for c in grid(n, k // 8):
            qg.PREFETCH_STEPS = 0
            us, err = timed(lambda w, c=c: qg.launch_gemm(x, w, None, y, config=c), True)
            res[str(c)] = us
        best = sorted((v, c) for c, v in res.items() if v)[:4]
        row["wide pdl"] = res
        row["best"] = best
        for v, c in best[:3]:
            cfg = eval(c)
            for pf in (2, 4, 8):
                qg.PREFETCH_STEPS = pf
                us, err = timed(lambda w, c=cfg: qg.launch_gemm(x, w, None, y, config=c), True)
                row[f"prefetch{pf} {c}"] = us
        qg.PREFETCH_STEPS = 0
        us, err = timed(lambda w: qg.launch_gemm(x, w, None, y), True)
        row["rule us"] = us
        p(f"{name:9s} bf16 {bf:7.1f} gemv {row['gemv pdl=False']:7.1f}/{row['gemv pdl=True']:7.1f} rule {us} best "
          + " ".join(f"{v:.1f}{c}" for v, c in best)
          + " | " + " ".join(f"{kk.split()[0]} {vv:.1f}" for kk, vv in row.items() if kk.startswith("prefetch") and vv)
          + f" | roofline {nbytes/4.24e6:.1f}")
        results.append(row)
        json.dump(results, open(out + "/sweep1.json", "w"), indent=1)
        del case
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
