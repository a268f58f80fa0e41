export PYTHONPATH=$PWD
mkdir -p $OUT/r; pack() { tar czf $OUT/run.tgz -C $OUT r; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $OUT/r/gpu.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> $OUT/r/gpu.txt
date >> $OUT/r/gpu.txt
timeout 240 python3 diag/sweep1.py > $OUT/r/sweep1.out 2>&1; pack
B="bench decode --preset llama3-8b --modes graphs --no-hf --batch-sizes 1 --rounds 2 --new-tokens 256 --quantization int4"
timeout 150 python3 diag/bench_wrap.py $B --out $OUT/r/base > $OUT/r/base.log 2>&1; pack
WIDE1=1 timeout 150 python3 diag/bench_wrap.py $B --out $OUT/r/wide > $OUT/r/wide.log 2>&1; pack
WIDE1=1 PF=4 timeout 150 python3 diag/bench_wrap.py $B --out $OUT/r/widepf > $OUT/r/widepf.log 2>&1; pack
