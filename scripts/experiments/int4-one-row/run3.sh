export PYTHONPATH=$PWD
R=/tmp/r; mkdir -p $R; pack() { tar czf $OUT/run.tgz -C /tmp r; }
{ date; nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > $R/gpu.txt
timeout 260 python3 -m fuselab bench decode --preset llama3-8b --quantization int4,int8,fp8 --batch-sizes 1,64 --modes graphs --no-hf --rounds 2 --out $R/decode-llama3-8b > $R/decode-8b.log 2>&1; pack
date >> $R/gpu.txt
timeout 80 python3 -m fuselab bench decode --preset llama3-1b --quantization int4 --batch-sizes 1 --modes graphs --no-hf --rounds 2 --out $R/decode-llama3-1b > $R/decode-1b.log 2>&1; pack
date >> $R/gpu.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/test_quant_kernels.py tests/test_quant_gemm.py > $R/gpu-tests.log 2>&1; pack
date >> $R/gpu.txt
(cd diag/old && PYTHONPATH=$PWD timeout 90 python3 -m fuselab bench decode --preset llama3-8b --quantization int4 --batch-sizes 1 --modes graphs --no-hf --rounds 2 --out $R/before-8b > $R/before-8b.log 2>&1); pack
date >> $R/gpu.txt
