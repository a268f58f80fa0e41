# A/B in one start: the fp32 one-row GEMV's late trigger (FUSELAB_PDL_FP32_LATE=1, "fp32late") on the 8B int4 and int8 shapes.
set -x
cd "$(dirname "$0")/../../.."
r=$OUT/r9; mkdir -p $r
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
rate() {  # label preset format
  case $1 in fp32late) f=1;; *) f=;; esac
  FUSELAB_PDL_FP32_LATE=$f PYTHONPATH=. timeout 150 python3 scripts/experiments/decode-ab/rate.py $2 $3 1 3 $1 >> $r/rates.jsonl 2>>$r/rates.err
  tail -1 $r/rates.jsonl
}
for v in main fp32late main fp32late; do rate $v llama3-8b int4; done
for v in main fp32late; do rate $v llama3-8b int8; done
for v in main fp32late; do rate $v llama3-1b fp8; done
