# A/B in one start: gemv_a8_config's rule (HEAD~1's tree, "new") against the commit before it ("prev", in .ab/prev),
# and short kernels letting the next kernel launch before their wait (FUSELAB_PDL_FIRST=all, "first").
set -x
cd "$(dirname "$0")/../../.."
R=$PWD; r=$OUT/r6; mkdir -p $r
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $r/env.txt
rate() {  # label preset format
  case $1 in prev) d=$R/.ab/prev; e=;; first) d=$R; e=all;; *) d=$R; e=;; esac
  FUSELAB_PDL_FIRST=$e PYTHONPATH=$d timeout 150 python3 scripts/experiments/decode-ab/rate.py $2 $3 1 3 $1 >> $r/rates.jsonl 2>>$r/rates.err
  tail -1 $r/rates.jsonl
}
for v in new first new first; do rate $v llama3-1b bf16; done
for v in prev new first prev new first; do rate $v llama3-8b int4; done
for v in new first new first; do rate $v llama3-8b bf16; done
for v in prev new first new; do rate $v llama3-8b int8; done
for v in new first; do rate $v llama3-1b int4; done
tail -3 $r/rates.err
