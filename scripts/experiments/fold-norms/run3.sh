# Quantized models' folded norms: A/B rows in one start (folded against the norm kernels, alternating in one
# process), then the GPU tests of the quantized fold; skips what would run past LIMIT seconds (default 230).
cd "$(dirname "$0")/../../.."
r=$OUT/quant; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
left() { [ $(( $(date +%s) - S + T )) -lt ${LIMIT:-230} ]; }
ab() { left || { echo "skip ab $*"; return; }
  timeout $T python3 scripts/experiments/fold-norms/ab.py "$@" >> $r/rates.jsonl 2>>$r/rates.err; tail -n 1 $r/rates.err; }
T=75 ab llama3-8b:int4 1 3 folded norms folded norms
T=50 ab llama3-1b:int4 1 3 folded norms folded norms
T=60; left && { timeout $T python3 -m pytest -q -p no:cacheprovider tests/test_quant_folded_norm.py \
  tests/test_quant_engine.py -k "folded or one_row" > $r/gpu-tests.log 2>&1; tail -1 $r/gpu-tests.log; }
T=60 ab llama3-8b:int8 1 3 folded norms
echo elapsed $(( $(date +%s) - S ))
python3 -c "
import json
for l in open('$r/rates.jsonl'):
    d=json.loads(l); print(d['preset'],d['format'],d['variant'],d['median'],d['rates'],d['same_tokens'])"
