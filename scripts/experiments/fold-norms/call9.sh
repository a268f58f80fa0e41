# One short device call: on an H200 the README's 1B bf16 row at this commit, then the 1B tile sweeps of run8.sh;
# elsewhere the 1B sweeps alone.
cd "$(dirname "$0")/../../.."
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
if echo "$GPU" | grep -q H200; then
  mkdir -p $OUT/h200 && (export OUT=$OUT/h200 && LIMIT=75 bash scripts/experiments/h200-refresh/run.sh)
fi
ONLY_1B=1 bash scripts/experiments/fold-norms/run8.sh
