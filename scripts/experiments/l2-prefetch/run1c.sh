# The quantized 8B formats with and without the prefetch, in one start, then the decode step's kernels (profile-decode).
cd "$(dirname "$0")/../../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1; r=$OUT/q; mkdir -p $r
for f in int4 int8 fp8; do
  timeout 110 python3 scripts/experiments/l2-prefetch/ab.py llama3-8b $f 1 3 off 30,6,6,6 40,8,8,8 30,0,0,0 off 30,6,6,6 >> $r/rates.jsonl 2>>$r/err
done
cat $r/rates.jsonl
