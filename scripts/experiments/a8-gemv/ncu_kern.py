"""Each 8B one-row projection kernel once, between cudaProfilerStart/Stop, for ncu."""
import torch
from fuselab.kernels import quantize_weight
from fuselab.kernels.linear import gemv_launch
from fuselab.kernels.quantized_linear import quantized_linear
from fuselab.kernels._common.launch import dependent_launches

torch.manual_seed(0)
dev = "cuda"
cases = []
for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}.items():
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    if name != "gate_up":
        cases.append((f"bf16 {name}", lambda x=x, w=w: gemv_launch(x, w, None)))
    for fmt in ("int4", "int8"):
        q = quantize_weight(w, fmt, 128)
        cases.append((f"{fmt} {name}", lambda x=x, q=q: quantized_linear(x, q)))
    del w
with dependent_launches():
    for _, fn in cases:
        fn(); fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, fn in cases:
        torch.cuda.nvtx.range_push(label)
        fn()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
print([c[0] for c in cases])
