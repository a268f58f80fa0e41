# A/B in one start: which quantized one-row GEMV's late trigger gave run7's 1B int4 gain: the fp32 GEMV
# (FUSELAB_PDL_FP32_LATE=1, "fp32late") or the int8-dot GEMV (FUSELAB_PDL_A8_LATE=1, "a8late"), against main.
set -x
cd "$(dirname "$0")/../../.."
r=$OUT/r8; mkdir -p $r
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $r/env.txt
rate() {  # label preset format
  case $1 in fp32late) f=1; a=;; a8late) f=; a=1;; *) f=; a=;; esac
  FUSELAB_PDL_FP32_LATE=$f FUSELAB_PDL_A8_LATE=$a PYTHONPATH=. timeout 150 python3 scripts/experiments/decode-ab/rate.py $2 $3 1 3 $1 >> $r/rates.jsonl 2>>$r/rates.err
  tail -1 $r/rates.jsonl
}
for v in main fp32late a8late main fp32late a8late; do rate $v llama3-1b int4; done
for v in main fp32late main fp32late; do rate $v llama3-8b fp8; done
for v in main fp32late; do rate $v llama3-1b int8; done
tail -3 $r/rates.err
