# (The first call ran this with the 1B int4 and 8B int4 rows as well, before ab.py captured under inference_mode.)
# Prefetch A/B rows in one start, the most important first; skips a row once too little of the call is left.
set -x
cd "$(dirname "$0")/../../.."
r=$OUT/l2-run1; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)" >> $r/env.txt
ab() { [ $(( $(date +%s) - S + T )) -lt 585 ] || { echo "skip $*"; return; }
  timeout $T python3 scripts/experiments/l2-prefetch/ab.py "$@" >> $r/rates.jsonl 2>>$r/rates.err; tail -n 2 $r/rates.err; tail -n 1 $r/rates.jsonl; }
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_l2_prefetch.py > $r/gpu-test.log 2>&1; tail -2 $r/gpu-test.log
T=150 ab llama3-8b bf16 1 3 off 40,8,8,8 20,8,8,8 off 60,10,10,10 40,8,8,8
T=90 ab llama3-1b bf16 1 3 off 25,6,6,6 12,6,6,6 off 40,8,8,8 25,6,6,6
T=120 ab llama3-8b bf16 64 2 off 40,8,8,8 off 40,8,8,8


echo elapsed $(( $(date +%s) - S ))
cat $r/rates.jsonl
