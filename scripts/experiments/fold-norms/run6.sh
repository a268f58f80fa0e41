# The paired gate/up GEMV's tile (rows, block_k, warps) against the split layout, 1B and 8B bf16, one process each.
cd "$(dirname "$0")/../../.."
r=$OUT/pair-tiles; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
timeout 150 python3 scripts/experiments/fold-norms/ab.py llama3-1b 1 3 split folded@2,2048,4 folded@4,2048,4 \
  folded@8,2048,8 folded@16,2048,8 folded@8,1024,4 split folded@4,2048,8 >> $r/rates.jsonl 2>>$r/rates.err
timeout 150 python3 scripts/experiments/fold-norms/ab.py llama3-8b 1 2 split folded@2,4096,8 folded@4,4096,8 \
  folded@8,2048,8 split >> $r/rates.jsonl 2>>$r/rates.err
python3 -c "
import json
for l in open('$r/rates.jsonl'):
    d=json.loads(l); print(d['preset'],d['variant'],d['median'],d['rates'],d['same_tokens'])"
grep -v Warning $r/rates.err | tail -3
