export PYTHONPATH=$PWD
mkdir -p $OUT/r; pack() { tar czf $OUT/run.tgz -C $OUT r; }
date > $OUT/r/gpu.txt
timeout 210 python3 diag/sweep2.py > $OUT/r/sweep2.out 2>&1; pack
export SWEEP=$OUT/r/sweep2.json
B="bench decode --preset llama3-8b --modes graphs --no-hf --batch-sizes 1,64 --rounds 2 --new-tokens 256 --quantization int4"
NEW=1 timeout 140 python3 diag/bench_wrap2.py $B --out $OUT/r/new8 > $OUT/r/new8.log 2>&1; pack
date >> $OUT/r/gpu.txt
B1="bench decode --preset llama3-1b --modes graphs --no-hf --batch-sizes 1 --rounds 2 --new-tokens 256 --quantization int4"
NEW=1 timeout 70 python3 diag/bench_wrap2.py $B1 --out $OUT/r/new1 > $OUT/r/new1.log 2>&1; pack
date >> $OUT/r/gpu.txt
timeout 140 python3 diag/bench_wrap2.py $B --out $OUT/r/base8 > $OUT/r/base8.log 2>&1; pack
date >> $OUT/r/gpu.txt
