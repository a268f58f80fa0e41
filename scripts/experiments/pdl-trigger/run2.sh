#!/bin/bash
# Needs the switches of commit e3ca58e (FUSELAB_PDL_EARLY); run it at that commit.
# Which kernels' early trigger costs bf16 (1B bisect), and early triggers on the quantized kernels alone at 8B.
export PYTHONUNBUFFERED=1
R=${RESULTS:-/tmp/results}; mkdir -p $R
save() { :; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $R/gpu.txt
B="python3 -m fuselab bench decode --modes graphs --no-hf --rounds 2"
i=0
for v in none all all,-merge all,-split all,-norm,-swiglu all,-gemv none all; do
  i=$((i+1)); FUSELAB_PDL_EARLY=$v timeout 60 $B --preset llama3-1b --out $R/1b-$i > $R/1b-$i.log 2>&1; echo "variant=$v rc=$?" >> $R/1b-$i.log; save
done
FUSELAB_PDL_EARLY=none timeout 150 $B --preset llama3-8b --quantization int4 --out $R/8b-none > $R/8b-none.log 2>&1; echo "rc=$?" >> $R/8b-none.log; save
FUSELAB_PDL_EARLY=quant timeout 150 $B --preset llama3-8b --quantization int4 --out $R/8b-quant > $R/8b-quant.log 2>&1; echo "rc=$?" >> $R/8b-quant.log; save
PYTHONPATH=. timeout 80 python3 diag/w8a8_one_row.py $R/w8a8.json > $R/w8a8.log 2>&1; echo "rc=$?" >> $R/w8a8.log; save
for i in 1 2 3 4 5 6 7 8; do echo "== 1b-$i $(tail -1 $R/1b-$i.log)"; grep -E "^│ graphs  " $R/1b-$i.log | head -2; done
for f in 8b-none 8b-quant; do echo "== $f"; grep -E "^│ graphs" $R/$f.log | head -6; done
tail -12 $R/w8a8.log
