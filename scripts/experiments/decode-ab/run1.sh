# The engine A/B: base (2366e5d), rr (4f6b517: rounded_rows), new (the
# working tree: rounded_rows + the int8-dot GEMV's prefetched scales and x codes), alternating.
set -x
cd "$(dirname "$0")/../../.."
R=$PWD; r=/tmp/r; mkdir -p $r
save() { tar czf $OUT/run1.tgz -C /tmp r; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)"; git log -1 --format=%H; } > $r/env.txt 2>&1
rate() { PYTHONPATH=$2 timeout 100 python3 scripts/experiments/decode-ab/rate.py $3 $4 1 3 $1 >> $r/rates.jsonl 2>>$r/rates.err; save; }
for p in 1 2; do for v in base rr new; do
  d=$R/.ab/$v; [ $v = new ] && d=$R
  rate $v $d llama3-8b int4
done; done
for v in base rr new; do d=$R/.ab/$v; [ $v = new ] && d=$R; rate $v $d llama3-8b int8; done
for v in base rr new; do d=$R/.ab/$v; [ $v = new ] && d=$R; rate $v $d llama3-1b int4; done
rate new $R llama3-8b bf16
cat $r/rates.jsonl; tail -3 $r/rates.err
