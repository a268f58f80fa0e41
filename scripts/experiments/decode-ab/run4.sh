# The landed change against base (2366e5d): rounded_rows reverted, int4's prefetched scales and x codes kept.
set -x
cd "$(dirname "$0")/../../.."
R=$PWD; r=/tmp/r4; mkdir -p $r
save() { tar czf $OUT/run4.tgz -C /tmp r4; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
rate() { PYTHONPATH=$2 timeout 100 python3 scripts/experiments/decode-ab/rate.py $3 $4 1 3 $1 >> $r/rates.jsonl 2>>$r/rates.err; save; }
for p in 1 2; do for v in base new; do d=$R/.ab/$v; [ $v = new ] && d=$R; rate $v $d llama3-8b int4; done; done
for v in base new; do d=$R/.ab/$v; [ $v = new ] && d=$R; rate $v $d llama3-8b int8; done
for p in 1 2; do for v in base new; do d=$R/.ab/$v; [ $v = new ] && d=$R; rate $v $d llama3-1b int4; done; done
PYTHONPATH=$R timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_quant_gemv_a8.py tests/test_quant_engine.py > $r/gpu-tests.log 2>&1; tail -3 $r/gpu-tests.log; save
PYTHONPATH=$R timeout 60 python3 scripts/profile-decode --preset llama3-8b --quantization int4 --json $r/profile-8b-int4.json > $r/profile-8b-int4.txt 2>&1; save
cat $r/rates.jsonl; head -16 $r/profile-8b-int4.txt
