# On an H200 the README's bf16 batch-1 rows first (the device), then the 1B tile sweep; elsewhere the
# whole sweep and a 1B profile.
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "GPU: $GPU"
if echo "$GPU" | grep -q H200; then
  mkdir -p $OUT/h200 && (export OUT=$OUT/h200 && LIMIT=190 bash scripts/experiments/h200-refresh/run.sh)
  export ONLY_1B=1
fi
bash scripts/experiments/fold-norms/run8.sh
