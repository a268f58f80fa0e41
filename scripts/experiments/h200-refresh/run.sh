# The README table's rows on an H200, in one start, most wanted first: bf16 at both shapes (batch 1), 8B bf16 at
# batch 64, then the quantized formats beside bf16. Each `fuselab bench decode` writes decode.json / decode.md /
# decode.png under $OUT/<name>; a row that would run past LIMIT seconds (default 560) is skipped.
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=.
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/env.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/env.txt
left() { [ $(( $(date +%s) - S + T )) -lt ${LIMIT:-560} ]; }
bench() { local name=$1; shift; left || { echo "skip $name"; return; }
  timeout $T python3 -m fuselab bench decode --modes graphs --no-hf --rounds 3 --out $OUT/$name "$@" \
    > $OUT/$name.log 2>&1; grep "tok/s, median" $OUT/$name.log; }
T=70 bench bf16-1b --preset llama3-1b --batch-sizes 1
T=110 bench bf16-8b --preset llama3-8b --batch-sizes 1
T=110 bench bf16-8b-b64 --preset llama3-8b --batch-sizes 64 --new-tokens 128
T=200 bench quant-8b --preset llama3-8b --batch-sizes 1 --quantization int4,int8,fp8
T=100 bench quant-1b --preset llama3-1b --batch-sizes 1 --quantization int4
echo elapsed $(( $(date +%s) - S ))
