# The step's ends in one launch each (the input rows, the final norm with the logits, the argmax into the token
# buffer) against the kernels before ("ends-old"), alternating in one process; then the GPU tests of the ops.
cd "$(dirname "$0")/../../.."
r=$OUT/ends; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
ab() { timeout $1 python3 scripts/experiments/fold-norms/ab.py "${@:2}" >> $r/rates.jsonl 2>>$r/rates.err; }
ab 170 llama3-1b 1 3 folded ends-old folded logits-old embed-old folded
ab 120 llama3-8b 1 2 folded ends-old folded
ab 100 llama3-1b:int4 1 3 folded ends-old folded
[ -n "$TESTS" ] && timeout 150 python3 -m pytest -q tests/test_kernels_embedding.py tests/test_kernels_argmax.py \
  tests/test_kernels_folded_norm.py tests/test_engine_gpu.py > $r/gpu-tests.log 2>&1
[ -n "$TESTS" ] && tail -3 $r/gpu-tests.log
python3 -c "
import json
for l in open('$r/rates.jsonl'):
    d=json.loads(l); print(d['preset'],d['format'],d['variant'],d['median'],d['rates'],d['same_tokens'])"
grep -v Warning $r/rates.err | tail -3
