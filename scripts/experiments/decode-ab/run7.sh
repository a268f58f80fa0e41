# GPU tests of the kernels whose triggers moved (with FUSELAB_PDL_FIRST=all, and as committed), the 8-bit graphs-vs-fused
# test at 12 sequences, and W8A8 against the weight-only GEMM at 9-16 rows.
set -x
cd "$(dirname "$0")/../../.."
r=$OUT/r7; mkdir -p $r
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
FUSELAB_PDL_FIRST=all timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_launch.py tests/test_quant_engine.py tests/test_engine_gpu.py -k "dependent or graphs or greedy" -x > $r/tests-first.log 2>&1
tail -5 $r/tests-first.log
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_quant_gemm_w8a8.py tests/test_quant_gemv_a8.py > $r/tests-w8a8.log 2>&1
tail -5 $r/tests-w8a8.log
timeout 150 python3 scripts/tune-quant-gemv --formats int8,fp8 --rows 9,12,16 --pdl --quick --jobs 14 --shapes qkv,o,gate_up,down --out $r/tune-9-16 > $r/tune.log 2>&1
tail -30 $r/tune-9-16/tune-quant-gemv.md
