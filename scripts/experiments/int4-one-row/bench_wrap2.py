import json, os, runpy, sys
import fuselab.kernels.quantized_linear as ql
import fuselab.kernels.quantized_gemm as qg
if os.environ.get("NEW"):
    qg.WIDE_INT4 = qg.WIDE_OFFSET
    table = {}
    for row in json.load(open(os.environ["SWEEP"])):
        if row["m"] == 1 and row["best v3"] and row["best v3"][0] < row["gemv"]:
            table[(row["n"], row["k"])] = eval(row["best v3"][1])
    print("one-row table", table, file=sys.stderr)
    gemv = ql._launch_gemv
    def one_row(x2, weight, bias, y2, config=None):
        c = table.get((weight.out_features, weight.in_features)) if weight.fmt == "int4" else None
        if c is None:
            gemv(x2, weight, bias, y2, config)
        else:
            qg.launch_gemm(x2, weight, bias, y2, config=c)
    ql._launch_gemv = one_row
sys.argv = ["fuselab"] + sys.argv[1:]
runpy.run_module("fuselab", run_name="__main__")
