"""int4: the bf16x2 wide kernel (variant 2) against the offset kernel (variant 3); M = 1 grid, M = 16 / 64 at the rule's tile."""
import json, os, sys, time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing as mp
import torch
sys.path.insert(0, "diag")
import sweep1 as s1
from fuselab.kernels._common.launch import dependent_launches, cdiv
tqg, ql, qg = s1.tqg, s1.ql, s1.qg
PREV = {row["shape"]: [eval(c) for _, c in row["best"][:3]] for row in json.load(open("diag/sweep1.json"))}

def v3(c):
    return c[:6] + (3,)

def compile_job(configs):
    torch.cuda.set_device(0)
    from fuselab.kernels import quantize_weight
    w = quantize_weight(torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16), "int4", 128)
    bad = []
    for c, m in configs:
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, 512, device="cuda", dtype=torch.bfloat16)
        try:
            with dependent_launches():
                qg.launch_gemm(x, w, None, y, config=c)
        except Exception as e:
            bad.append((c, str(e)[:300]))
    torch.cuda.synchronize()
    return bad

def mconfigs(m, n, n_words):
    rule = qg.gemm_config(m, n, n_words, "int4", 132)
    out = {rule, v3(rule)}
    for bn, bw in ((64, 64), (128, 32), (128, 64), (256, 32)):
        if n_words % bw: continue
        for split in (1, 2, 4):
            tiles = cdiv(m, rule[0]) * cdiv(n, bn)
            if split > 1 and tiles * split > 2 * 132: continue
            c = (rule[0], bn, bw, split, qg.gemm_num_warps(rule[0], bn, bw), 3, 3)
            if qg.gemm_shared_bytes(*c[:3], "int4", 3, 2, 3) <= 220 * 1024:
                out.add(c)
    return sorted(out)

def main():
    out = os.environ["OUT"] + "/r"
    log = open(out + "/sweep2.log", "w")
    def p(*a):
        s = " ".join(map(str, a)); print(s, flush=True); log.write(s + "\n"); log.flush()
    plan = {}
    for name, (n, k) in s1.SHAPES.items():
        plan[(name, 1)] = sorted(set(PREV[name]) | {v3(c) for c in s1.grid(n, k // 8)})
        if not name.endswith("1"):
            for m in (16, 64):
                plan[(name, m)] = mconfigs(m, n, k // 8)
    units = sorted({(c, min(m, 16) if m < 64 else 64) for (name, m), cs in plan.items() for c in cs})
    t0 = time.time()
    with ProcessPoolExecutor(14, mp_context=mp.get_context("spawn")) as ex:
        for bad in ex.map(compile_job, [units[i::14] for i in range(14)]):
            for b in bad: p("COMPILE FAIL", b)
    p(f"compiled {len(units)} units in {time.time()-t0:.0f} s")
    results = []
    for name, (n, k) in s1.SHAPES.items():
        case = tqg.Case("int4", name, n, k, "cuda", True)
        for m in (1, 16, 64):
            if (name, m) not in plan: continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = case.reference(x); scale = ref.abs().max().item()
            def timed(fn):
                y.fill_(float("nan")); fn(case.weight)
                err = ((y.float() - ref).abs().max() / scale).item()
                if not err <= 2e-2: return None, err
                def chain():
                    with dependent_launches():
                        for w in case.weights: fn(w)
                return tqg._time([chain], False) / len(case.weights), err
            row = {"shape": name, "n": n, "k": k, "m": m, "bytes": case.weight.nbytes}
            row["bf16"] = tqg._time([lambda w=w: torch.matmul(x, w.t(), out=y) for w in case.dense], False)
            if m == 1:
                row["gemv"] = timed(lambda w: ql._launch_gemv(x, w, None, y))[0]
            row["rule v2"] = timed(lambda w: qg.launch_gemm(x, w, None, y))[0]
            res = {}
            for c in plan[(name, m)]:
                us, err = timed(lambda w, c=c: qg.launch_gemm(x, w, None, y, config=c))
                res[str(c)] = (us, err)
            row["configs"] = res
            b2 = min(((v[0], c) for c, v in res.items() if v[0] and c.endswith(" 2)")), default=None)
            b3 = min(((v[0], c) for c, v in res.items() if v[0] and c.endswith(" 3)")), default=None)
            row["best v2"], row["best v3"] = b2, b3
            rv3 = res.get(str(v3(qg.gemm_config(m, n, k // 8, "int4", 132))))
            p(f"{name:9s} M={m:<3d} bf16 {row['bf16']:7.1f} gemv {row.get('gemv')} rule-v2 {row['rule v2']:.1f} "
              f"rule-v3 {rv3} best-v2 {b2} best-v3 {b3} roofline {case.weight.nbytes/4.24e6:.1f}")
            results.append(row)
            json.dump(results, open(out + "/sweep2.json", "w"), indent=1)
        del case
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
