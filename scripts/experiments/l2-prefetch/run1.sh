# A/B in one start: weights prefetched into L2 on a side stream (ab.py, the engine's WeightPrefetch) against the
# plain decode step; one row's gate/up and SwiGLU as one Triton launch (FUSELAB_GRAPH_GATE_UP=fused); then the
# short kernels' late triggers (FUSELAB_PDL_LATE=1, in a separate Triton cache).
# ~9-10 minutes on a fresh machine. Rates: $OUT/l2-run1/rates.jsonl, one line a variant.
set -x
cd "$(dirname "$0")/../../.."
r=$OUT/l2-run1; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda)" >> $r/env.txt
ab() { timeout ${T:-200} python3 scripts/experiments/l2-prefetch/ab.py "$@" >> $r/rates.jsonl 2>>$r/rates.err; tail -n 3 $r/rates.err; }
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_l2_prefetch.py > $r/gpu-test.log 2>&1; tail -2 $r/gpu-test.log
T=150 ab llama3-8b bf16 1 3 off 40,8,8,8 20,8,8,8 off 60,10,10,10 40,8,8,8
T=90 ab llama3-1b bf16 1 3 off 25,6,6,6 12,6,6,6 off 40,8,8,8 25,6,6,6
T=150 ab llama3-8b int4 1 3 off 17,4,4,4 30,6,6,6 off
T=90 ab llama3-1b int4 1 3 off 12,4,4,4 off
echo gate-up-fused >> $r/rates.jsonl
FUSELAB_GRAPH_GATE_UP=fused T=120 ab llama3-8b bf16 1 3 off off
FUSELAB_GRAPH_GATE_UP=fused T=90 ab llama3-1b bf16 1 3 off off
echo late >> $r/rates.jsonl
FUSELAB_PDL_LATE=1 TRITON_CACHE_DIR=/tmp/tc-late T=120 ab llama3-8b bf16 1 3 off 40,8,8,8 off
cat $r/rates.jsonl
