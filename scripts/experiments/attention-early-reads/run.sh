# Early-reads A/B rows in one start, the most important first; skips a row once too little of the call is left.
cd "$(dirname "$0")/../../.."
r=$OUT/early; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)" >> $r/env.txt
ab() { [ $(( $(date +%s) - S + T )) -lt 585 ] || { echo "skip $*"; return; }
  timeout $T python3 scripts/experiments/attention-early-reads/ab.py "$@" >> $r/rates.jsonl 2>>$r/rates.err; tail -n 2 $r/rates.err; tail -n 3 $r/rates.jsonl; }
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_rope_decode.py > $r/gpu-test.log 2>&1; tail -2 $r/gpu-test.log
T=120 ab llama3-1b bf16 1 3 0 1 2 0 1 2
T=170 ab llama3-8b bf16 1 3 0 1 2 0 1 2
T=130 ab llama3-8b bf16 64 2 0 2 0 2
T=100 ab llama3-1b int4 1 3 0 1 2 0
echo elapsed $(( $(date +%s) - S ))
