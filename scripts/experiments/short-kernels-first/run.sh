# short_kernels_first A/B rows in one start, the most important first; skips a row once too little of the call is left.
cd "$(dirname "$0")/../../.."
r=$OUT/first; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)" >> $r/env.txt
ab() { [ $(( $(date +%s) - S + T )) -lt ${LIMIT:-420} ] || { echo "skip $*"; return; }
  timeout $T python3 scripts/experiments/short-kernels-first/ab.py "$@" >> $r/rates.jsonl 2>>$r/rates.err; tail -n 1 $r/rates.err; }
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_launch.py > $r/gpu-test.log 2>&1; tail -1 $r/gpu-test.log
T=70 ab llama3-1b bf16 1 3 after first after first
T=90 ab llama3-8b bf16 1 3 after first after first
T=90 ab llama3-1b int4 1 3 after first after first
T=90 ab llama3-8b bf16 64 2 after first after first
T=80 ab llama3-8b int4 1 3 after first
echo elapsed $(( $(date +%s) - S ))
python3 -c "
import json,sys
for l in open('$r/rates.jsonl'):
    d=json.loads(l); print(d['preset'],d['format'],d['batch'],d['variant'],d['median'],d['same_tokens'])"
