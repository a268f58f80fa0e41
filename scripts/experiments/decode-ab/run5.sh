# gemv_a8_config's new rule (HEAD) against the commit before (prev): its configs, then the engine A/B.
set -x
cd "$(dirname "$0")/../../.."
R=$PWD; r=$OUT/r5; mkdir -p $r
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
PYTHONPATH=$R timeout 90 python3 scripts/tune-quant-gemv --formats int4,int8 --rows 1 --pdl --quick --jobs 14 --shapes qkv,o,down,1b-down --out $r > $r/tune.log 2>&1
rate() { PYTHONPATH=$2 timeout 90 python3 scripts/experiments/decode-ab/rate.py $3 $4 1 3 $1 >> $r/rates.jsonl 2>>$r/rates.err; }
for p in 1 2; do for v in prev new; do d=$R/.ab/$v; [ $v = new ] && d=$R; rate $v $d llama3-8b int8; done; done
for v in prev new; do d=$R/.ab/$v; [ $v = new ] && d=$R; rate $v $d llama3-8b int4; done
for v in prev new; do d=$R/.ab/$v; [ $v = new ] && d=$R; rate $v $d llama3-1b int8; done
cat $r/rates.jsonl; tail -2 $r/rates.err; grep -E "rule" $r/tune-quant-gemv.md | head -12
