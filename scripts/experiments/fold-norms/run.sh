# Folded norms: GPU tests, then A/B rows in one start, the most important first; skips a row once too little
# of the call is left (LIMIT seconds, default 540).
cd "$(dirname "$0")/../../.."
r=$OUT/fold; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)" >> $r/env.txt
left() { [ $(( $(date +%s) - S + T )) -lt ${LIMIT:-540} ]; }
ab() { left || { echo "skip ab $*"; return; }
  timeout $T python3 scripts/experiments/fold-norms/ab.py "$@" >> $r/rates.jsonl 2>>$r/rates.err; tail -n 1 $r/rates.err; }
T=70 ab llama3-1b 1 3 folded norms folded norms
T=100 ab llama3-8b 1 3 folded norms folded norms
T=60; left && { timeout $T python3 -m pytest -q -p no:cacheprovider tests/test_kernels_folded_norm.py tests/test_kernels_linear.py \
  tests/test_kernels_swiglu.py "tests/test_engine_hf.py" -k "folded or keeps or fused or linear or swiglu" > $r/gpu-tests.log 2>&1; tail -1 $r/gpu-tests.log; }
T=60; left && { timeout $T python3 scripts/profile-decode --preset llama3-1b --json $r/profile-1b.json > $r/profile-1b.txt 2>&1; tail -3 $r/profile-1b.txt; }
T=170; left && { timeout $T python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py > $r/engine-gpu.log 2>&1; tail -1 $r/engine-gpu.log; }
echo elapsed $(( $(date +%s) - S ))
python3 -c "
import json
for l in open('$r/rates.jsonl'):
    d=json.loads(l); print(d['preset'],d['batch'],d['variant'],d['median'],d['rates'],d['same_tokens'])"
