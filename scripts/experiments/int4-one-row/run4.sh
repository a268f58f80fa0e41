R=/tmp/r; mkdir -p $R; pack() { tar czf $OUT/run.tgz -C /tmp r; }
date > $R/gpu.txt
for v in split nosplit; do
  if [ $v = split ]; then P=$PWD/diag/cur; else P=$PWD; fi
  (cd $P && PYTHONPATH=$P timeout 60 python3 -m fuselab bench decode --preset llama3-8b --quantization int4 --batch-sizes 1 --modes graphs --no-hf --rounds 2 --out $R/$v-8b > $R/$v-8b.log 2>&1); pack
  date >> $R/gpu.txt
done
