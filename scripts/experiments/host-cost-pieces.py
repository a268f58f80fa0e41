"""Where the host time of the four ops over 1.5x goes, on the GPU host."""
import time, statistics, json, sys
import torch, torch.nn.functional as F
import triton, triton.language as tl
from fuselab import kernels
from fuselab.kernels import rope, rope_store, gate_up_swiglu as gus
from fuselab.kernels.attention import paged_attention as pa
from fuselab.kernels._common import fast_launch
from fuselab.kernels._common.launch import use_pdl

dev = "cuda"
bf16 = torch.bfloat16
res = {}

def host_us(fn, n=300, reps=7):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0) / n * 1e6)
    return round(statistics.median(out), 2), round(min(out), 2)

def gpu_us(fn, n=50):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10): g.replay()
    b.record(); torch.cuda.synchronize()
    return round(a.elapsed_time(b) / 10 / n * 1e3, 2)

with torch.device(dev):
    x = torch.randn(1, 4096, dtype=bf16); w = torch.ones(4096, dtype=bf16)
    qkv = torch.randn(1, 6144, dtype=bf16)
    q, k, v = (qkv[:, a:b].view(1, -1, 128) for a, b in ((0, 4096), (4096, 5120), (5120, 6144)))
    positions = torch.zeros(1, dtype=torch.int64)
    k_cache = torch.zeros(64, 16, 8, 128, dtype=bf16); v_cache = torch.zeros_like(k_cache)
    slots = torch.zeros(1, dtype=torch.int32)
    tables, lengths = torch.zeros(1, 64, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    q_decode = torch.randn(1, 32, 128, dtype=bf16)
    counters = torch.zeros(8, dtype=torch.int32)
    wgu_big = (torch.randn(4096, 2048, dtype=bf16) * 0.02).t()
    wgu_small = (torch.randn(1024, 512, dtype=bf16) * 0.02).t()
    x1k = torch.randn(1, 1024, dtype=bf16)
cos_sin = kernels.rope_cos_sin(2048, 128, device=dev)

cases = {
  "F.rms_norm": lambda: F.rms_norm(x, (4096,), w, 1e-6),
  "rms_norm": lambda: kernels.rms_norm(x, w, 1e-6),
  "apply_rope": lambda: kernels.apply_rope(q, k, positions, cos_sin),
  "rope_and_store_kv": lambda: kernels.rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots),
  "decode_attention": lambda: kernels.decode_attention(q_decode, k_cache, v_cache, tables, lengths, 0.1, max_seq_len=2048, counters=counters),
  "gate_up 4096->2x1024 sk1": lambda: kernels.gate_up_swiglu(x, wgu_big, max_split_k=1),
  "gate_up 4096->2x1024 default": lambda: kernels.gate_up_swiglu(x, wgu_big),
  "gate_up 1024->2x256 sk1": lambda: kernels.gate_up_swiglu(x1k, wgu_small, max_split_k=1),
  # pieces
  "empty_like(q)": lambda: torch.empty_like(q),
  "empty(1,4096)": lambda: torch.empty((1, 4096), dtype=bf16, device=dev),
  "empty_like x2": lambda: (torch.empty_like(q), torch.empty_like(k)),
  "q.device": lambda: q.device,
  "q.get_device()": lambda: q.get_device(),
  "q.data_ptr()": lambda: q.data_ptr(),
  "q.stride()": lambda: q.stride(),
  "q.shape": lambda: q.shape,
  "q.is_contiguous()": lambda: q.is_contiguous(),
  "use_pdl(q.device)": lambda: use_pdl(q.device),
  "raw_stream": lambda: torch._C._cuda_getCurrentRawStream(0),
  "cuda_getDevice": lambda: torch._C._cuda_getDevice(),
  "grad_enabled": lambda: torch.is_grad_enabled(),
  "rope _decode_layout_ok": lambda: rope._decode_layout_ok(q, k, positions, cos_sin, "rotate_half"),
  "rope_store _decode_layout_ok": lambda: rope_store._decode_layout_ok(q, k, v, positions, cos_sin, k_cache, v_cache, slots, "rotate_half"),
}

@triton.jit
def _k1(a, n):
    if tl.program_id(0) < 0: tl.store(a, n)
@triton.jit
def _k3(a, b, c, n):
    if tl.program_id(0) < 0: tl.store(a, n)
@triton.jit
def _k6(a, b, c, d, e, f, n):
    if tl.program_id(0) < 0: tl.store(a, n)
@triton.jit
def _k10(a, b, c, d, e, f, g, h, i, j, n):
    if tl.program_id(0) < 0: tl.store(a, n)
ts = [torch.zeros(16, device=dev) for _ in range(10)]
for kern, m in ((_k1, 1), (_k3, 3), (_k6, 6), (_k10, 10)):
    p = fast_launch.prepare(kern, num_warps=1)
    cases[f"prepared launch {m} tensors"] = (lambda p=p, m=m: p((1,), *ts[:m], 5))
pk = fast_launch.prepare(_k1, num_warps=1)
cases["prepared launch 1 tensor, pdl kw"] = lambda: pk((1,), ts[0], 5)

with torch.inference_mode():
    for name, fn in cases.items():
        for _ in range(20): fn()
    torch.cuda.synchronize()
    for name, fn in cases.items():
        h = host_us(fn)
        try:
            g = gpu_us(fn) if not name.startswith(("q.", "use_pdl", "raw", "cuda_", "grad", "rope ", "rope_store ", "empty")) else None
        except Exception as e:
            g = f"err {type(e).__name__}"
        res[name] = {"host_median": h[0], "host_min": h[1], "gpu": g}
        print(f"{name:40s} host {h[0]:7.2f} (min {h[1]:7.2f})  gpu {g}", flush=True)
    # bare C launcher (no binder): grab a Bound from the prepared launch's binder
    p = fast_launch.prepare(_k6, num_warps=1)
    p((1,), *ts[:6], 5)
    torch.cuda.synchronize()
json.dump(res, open(sys.argv[1], "w"), indent=1)
