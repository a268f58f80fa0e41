#!/bin/bash
# Run from the repository root on a GPU; run3 expects the tree of the commit before (b9ef7e0) in diag/old.
# The change (early triggers + W8A8 at one row for large 8-bit weights) against b9ef7e0, one start.
export PYTHONUNBUFFERED=1
R=${RESULTS:-/tmp/results}; mkdir -p $R
save() { :; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.version.cuda)" >> $R/gpu.txt
B="python3 -m fuselab bench decode --modes graphs --no-hf --rounds 2"
timeout 270 $B --preset llama3-8b --quantization int4,int8,fp8 --batch-sizes 1,64 --out $R/after-8b > $R/after-8b.log 2>&1; echo "rc=$?" >> $R/after-8b.log; save
(cd diag/old && PYTHONPATH=$PWD timeout 130 $B --preset llama3-8b --quantization int4,int8 --out $R/before-8b > $R/before-8b.log 2>&1; echo "rc=$?" >> $R/before-8b.log); save
timeout 60 $B --preset llama3-1b --quantization int4,int8 --out $R/after-1b > $R/after-1b.log 2>&1; echo "rc=$?" >> $R/after-1b.log; save
(cd diag/old && PYTHONPATH=$PWD timeout 60 $B --preset llama3-1b --quantization int4 --out $R/before-1b > $R/before-1b.log 2>&1; echo "rc=$?" >> $R/before-1b.log); save
timeout 40 python3 -m pytest -q -x tests/test_quant_gemm_w8a8.py tests/test_kernels_launch.py > $R/tests.log 2>&1; echo "rc=$?" >> $R/tests.log; save
for f in after-8b before-8b after-1b before-1b; do echo "== $f $(tail -1 $R/$f.log)"; grep -E "^│ graphs" $R/$f.log | cut -c1-200; done
tail -3 $R/tests.log
