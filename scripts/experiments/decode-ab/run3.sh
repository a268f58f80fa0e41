# The 1B bench, a profile of the 8B int4 step, and the int8-dot GEMV's configs with the prefetched scales.
set -x
cd "$(dirname "$0")/../../.."
r=/tmp/r3; mkdir -p $r
save() { tar czf $OUT/run3.tgz -C /tmp r3; }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m fuselab bench decode --preset llama3-1b --quantization int4,int8 --batch-sizes 1 --modes graphs --no-hf --rounds 2 --out $r/b1 > $r/bench-1b.log 2>&1; save
timeout 60 python3 scripts/profile-decode --preset llama3-8b --quantization int4 --json $r/profile-8b-int4.json > $r/profile-8b-int4.txt 2>&1; save
timeout 200 python3 scripts/tune-quant-gemv --formats int4,int8 --rows 1 --pdl --quick --jobs 14 --shapes qkv,o,gate_up,down,lm_head,1b-gate_up,1b-down,1b-lm_head --out $r/tune > $r/tune.log 2>&1; save
grep -E "median" $r/bench-1b.log; head -20 $r/profile-8b-int4.txt; grep "gemv-a8" $r/tune/tune-quant-gemv.md | head -24
