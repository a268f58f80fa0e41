# The float GEMV's tiles for the paired gate/up (1B and 8B) and the logits over the tied table (1B), each against
# the built tiles ("folded") in the same process, batch 1.
cd "$(dirname "$0")/../../.."
r=$OUT/tiles; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
ab() { timeout $1 python3 scripts/experiments/fold-norms/ab.py "${@:2}" >> $r/rates.jsonl 2>>$r/rates.err; }
ab 200 llama3-1b 1 3 folded folded@head=4,2048,4 folded@head=4,2048,8 folded folded@head=8,2048,8 \
  folded@head=1,2048,4 folded folded@head=16,1024,4 folded
ab 200 llama3-1b 1 3 folded folded@pair=2,2048,8 folded@pair=4,2048,4 folded folded@pair=4,2048,8 \
  folded@pair=8,2048,8 folded folded@pair=2,2048,2 folded
[ -z "$ONLY_1B" ] && ab 150 llama3-8b 1 2 folded folded@pair=2,4096,4 folded@pair=4,4096,8 folded folded@pair=2,2048,4 folded
[ -z "$ONLY_1B" ] && timeout 60 python3 scripts/profile-decode --preset llama3-1b --mode graphs > $r/prof-llama3-1b.txt 2>&1
python3 -c "
import json
for l in open('$r/rates.jsonl'):
    d=json.loads(l); print(d['preset'],d['variant'],d['median'],d['rates'],d['same_tokens'])"
grep -v Warning $r/rates.err | tail -3
grep -A12 'kernels,' $r/prof-llama3-1b.txt
