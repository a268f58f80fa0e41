import os, runpy, sys
import fuselab.kernels.quantized_linear as ql
import fuselab.kernels.quantized_gemm as qg
if os.environ.get("WIDE1"):
    ql.GEMV_MAX_ROWS = 0
qg.PREFETCH_STEPS = int(os.environ.get("PF", "0"))
sys.argv = ["fuselab"] + sys.argv[1:]
runpy.run_module("fuselab", run_name="__main__")
