# The other two switches of 3721393 (one-launch gate/up in graphs mode, late triggers) against the plain step, one start.
cd "$(dirname "$0")/../../.."
r=$OUT/l2-run1; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=.
ab() { timeout $T python3 scripts/experiments/l2-prefetch/ab.py "$@" >> $r/rates.jsonl 2>>$r/rates.err; tail -n 1 $r/rates.err; }
echo gate-up-fused >> $r/rates.jsonl
FUSELAB_GRAPH_GATE_UP=fused T=100 ab llama3-8b bf16 1 3 off off
FUSELAB_GRAPH_GATE_UP=fused T=80 ab llama3-1b bf16 1 3 off off
echo late >> $r/rates.jsonl
FUSELAB_PDL_LATE=1 TRITON_CACHE_DIR=/tmp/tc-late T=120 ab llama3-8b bf16 1 3 off off
FUSELAB_PDL_LATE=1 TRITON_CACHE_DIR=/tmp/tc-late T=100 ab llama3-1b bf16 1 3 off off
echo base >> $r/rates.jsonl
T=80 ab llama3-8b bf16 1 3 off off
T=80 ab llama3-1b bf16 1 3 off off
cat $r/rates.jsonl
