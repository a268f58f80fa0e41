# One start: gate/up as (gate, up) row pairs (one GEMV with the norm and SwiGLU at one row) against the layout
# before, alternating in one process, bf16; then the quantized fold's A/B (run3.sh). LIMIT: seconds in all.
cd "$(dirname "$0")/../../.."
r=$OUT/pairs; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/env.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/env.txt
left() { [ $(( $(date +%s) - S + T )) -lt ${LIMIT:-560} ]; }
ab() { left || { echo "skip ab $*"; return; }
  timeout $T python3 scripts/experiments/fold-norms/ab.py "$@" >> $r/rates.jsonl 2>>$r/rates.err; tail -n 1 $r/rates.err; }
T=70 ab llama3-1b 1 3 folded split folded split
T=100 ab llama3-8b 1 3 folded split folded
T=100 ab llama3-8b 64 3 folded split
python3 -c "
import json
for l in open('$r/rates.jsonl'):
    d=json.loads(l); print(d['preset'],d['batch'],d['variant'],d['median'],d['rates'],d['same_tokens'])"
echo pairs elapsed $(( $(date +%s) - S ))
LIMIT=$(( ${LIMIT:-560} - $(date +%s) + S )) bash scripts/experiments/fold-norms/run3.sh
