# A/B in one start: weights prefetched into L2 on a side stream (ab.py) against the plain decode step; and the short
# kernels' late triggers (FUSELAB_PDL_LATE=1, a separate Triton cache).
set -x
cd "$(dirname "$0")/../../.."
r=$OUT/l2-run1; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)" >> $r/env.txt
ab() { timeout ${T:-200} python3 scripts/experiments/l2-prefetch/ab.py "$@" >> $r/rates.jsonl 2>>$r/rates.err; tail -n 3 $r/rates.err; }

T=150 ab llama3-8b bf16 1 3 off 40,8,8,8 off
T=90 ab llama3-1b bf16 1 2 off 25,6,6,6

cat $r/rates.jsonl
