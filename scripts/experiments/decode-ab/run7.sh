# A/B in one start: the quantized one-row GEMVs letting the next kernel launch after their loop ("late",
# FUSELAB_PDL_A8_LATE=1), alone and with the short kernels triggering before their wait ("firstlate",
# FUSELAB_PDL_FIRST=all as well), against main's placement ("main").
set -x
cd "$(dirname "$0")/../../.."
r=$OUT/r7; mkdir -p $r
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $r/env.txt
rate() {  # label preset format
  case $1 in late) f=; l=1;; firstlate) f=all; l=1;; first) f=all; l=;; *) f=; l=;; esac
  FUSELAB_PDL_FIRST=$f FUSELAB_PDL_A8_LATE=$l PYTHONPATH=. timeout 150 python3 scripts/experiments/decode-ab/rate.py $2 $3 1 3 $1 >> $r/rates.jsonl 2>>$r/rates.err
  tail -1 $r/rates.jsonl
}
for v in main late firstlate main late firstlate; do rate $v llama3-8b int4; done
for v in main late firstlate main late firstlate; do rate $v llama3-1b int4; done
for v in main late firstlate; do rate $v llama3-8b int8; done
tail -3 $r/rates.err
