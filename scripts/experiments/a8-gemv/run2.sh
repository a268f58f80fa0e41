set -x
mkdir -p /tmp/r; cd "$(dirname "$0")/.."
R=$PWD; A=$R/diag/a8
save() { tar czf $OUT/run.tgz -C /tmp r; }
nvidia-smi --query-gpu=name,driver_version --format=csv > /tmp/r/gpu.txt
(cd $A && PYTHONPATH=$A timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_quant_gemv_a8.py > /tmp/r/gpu-tests.log 2>&1); tail -3 /tmp/r/gpu-tests.log; save
(cd $A && PYTHONPATH=$A timeout 200 python3 scripts/tune-quant-gemv --formats int4,int8 --rows 1 --pdl --quick --jobs 14 \
  --shapes qkv,o,gate_up,down,lm_head,1b-qkv,1b-o,1b-gate_up,1b-down,1b-lm_head --out /tmp/r/tune > /tmp/r/tune.log 2>&1); tail -25 /tmp/r/tune.log; save
for q in int4 int8; do for v in 0 small all; do
  FUSELAB_A8=$v PYTHONPATH=$A timeout 80 python3 diag/rate.py llama3-8b $q 1 3 $q-a8-$v >> /tmp/r/ab2.jsonl 2>>/tmp/r/ab2.err; save
done; done
for v in 0 small all; do
  FUSELAB_A8=$v PYTHONPATH=$A timeout 50 python3 diag/rate.py llama3-1b int4 1 3 1b-int4-a8-$v >> /tmp/r/ab2.jsonl 2>>/tmp/r/ab2.err; save
done
cat /tmp/r/ab2.jsonl; tail -5 /tmp/r/ab2.err
