#!/bin/bash
# Needs the switch of commit 07ea289 (FUSELAB_PDL_TRIGGER); run it at that commit.
# A/B of the dependent-launch trigger (late = as before, early = right after each kernel's wait), one start.
export PYTHONUNBUFFERED=1
R=${RESULTS:-/tmp/results}; mkdir -p $R
save() { :; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $R/gpu.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $R/gpu.txt
git log -1 --format=%H >> $R/gpu.txt
B="python3 -m fuselab bench decode --modes graphs --no-hf --rounds 2"
FUSELAB_PDL_TRIGGER=late timeout 170 $B --preset llama3-8b --quantization int4,int8 --out $R/8b-late > $R/8b-late.log 2>&1; echo "rc=$?" >> $R/8b-late.log; save
FUSELAB_PDL_TRIGGER=early timeout 170 $B --preset llama3-8b --quantization int4,int8 --out $R/8b-early > $R/8b-early.log 2>&1; echo "rc=$?" >> $R/8b-early.log; save
FUSELAB_PDL_TRIGGER=late timeout 70 $B --preset llama3-1b --quantization int4 --out $R/1b-late > $R/1b-late.log 2>&1; echo "rc=$?" >> $R/1b-late.log; save
FUSELAB_PDL_TRIGGER=early timeout 70 $B --preset llama3-1b --quantization int4 --out $R/1b-early > $R/1b-early.log 2>&1; echo "rc=$?" >> $R/1b-early.log; save
timeout 60 python3 -m pytest -q -x tests/test_kernels_launch.py tests/test_fast_launch.py > $R/tests.log 2>&1; echo "rc=$?" >> $R/tests.log; save
timeout 80 python3 diag/w8a8_one_row.py $R/w8a8.json > $R/w8a8.log 2>&1; echo "rc=$?" >> $R/w8a8.log; save
for f in 8b-late 8b-early 1b-late 1b-early; do echo "== $f"; grep -E "graphs|tok/s|rc=" $R/$f.log | tail -8; done
tail -3 $R/tests.log; tail -12 $R/w8a8.log
