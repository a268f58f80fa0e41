# One start: gate/up as (gate, up) row pairs (one GEMV with the norm and SwiGLU at one row) against the layout
# before (split), alternating in one process, bf16 batch 1; then the paired GEMV's GPU tests. LIMIT: seconds in all.
cd "$(dirname "$0")/../../.."
r=$OUT/pairs; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
left() { [ $(( $(date +%s) - S + T )) -lt ${LIMIT:-300} ]; }
ab() { left || { echo "skip ab $*"; return; }
  timeout $T python3 scripts/experiments/fold-norms/ab.py "$@" >> $r/rates.jsonl 2>>$r/rates.err; tail -n 1 $r/rates.err; }
T=70 ab llama3-1b 1 3 folded split folded split
T=80 ab llama3-8b 1 2 folded split
python3 -c "
import json
for l in open('$r/rates.jsonl'):
    d=json.loads(l); print(d['preset'],d['batch'],d['variant'],d['median'],d['rates'],d['same_tokens'])"
T=50; left && { timeout $T python3 -m pytest -q -p no:cacheprovider tests/test_kernels_folded_norm.py -k swiglu \
  > $r/gpu-tests.log 2>&1; tail -1 $r/gpu-tests.log; }
echo elapsed $(( $(date +%s) - S ))
