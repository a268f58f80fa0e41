# The changed kernels' tests compiled on the GPU, then the 8B bench of the landed code.
set -x
cd "$(dirname "$0")/../../.."
r=/tmp/r2; mkdir -p $r
save() { tar czf $OUT/run2.tgz -C /tmp r2; }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_rounded_rows.py tests/test_quant_gemv_a8.py tests/test_quant_engine.py > $r/gpu-tests.log 2>&1; tail -3 $r/gpu-tests.log; save
timeout 400 python3 -m fuselab bench decode --preset llama3-8b --quantization int4,int8,fp8 --batch-sizes 1,64 --modes graphs --no-hf --rounds 2 --out $r/b8 > $r/bench-8b.log 2>&1; save
grep -E "median|Error|error" $r/bench-8b.log | tail -12
