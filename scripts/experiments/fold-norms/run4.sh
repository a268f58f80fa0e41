# One start: on an H200, main's bf16 decode rates (MAIN: a copy of main's package, carried); then the quantized
# fold's A/B (run3.sh) on this build.
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1
S=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/env.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $OUT/env.txt
if grep -q H200 $OUT/env.txt; then
  bench() { local name=$1; shift
    PYTHONPATH=$MAIN timeout 170 python3 -m fuselab bench decode --modes graphs --no-hf --rounds 3 --out $OUT/$name "$@" \
      > $OUT/$name.log 2>&1; grep "tok/s, median" $OUT/$name.log; }
  bench bf16-1b --preset llama3-1b --batch-sizes 1
  bench bf16-8b --preset llama3-8b --batch-sizes 1
  bench bf16-8b-b64 --preset llama3-8b --batch-sizes 64 --new-tokens 128
fi
echo bench elapsed $(( $(date +%s) - S ))
LIMIT=${QLIMIT:-230} bash scripts/experiments/fold-norms/run3.sh
