import importlib, json, sys, os
import torch, triton
sys.path.insert(0, os.path.dirname(__file__))
import ce_variants as cv
from fuselab.device import ceilings
from fuselab.timing import bench
ce = importlib.import_module("fuselab.kernels.cross_entropy")
dev = "cuda" if torch.cuda.is_available() else "cpu"
copy = ceilings().copy_bandwidth_gbs if dev == "cuda" else 1.0
rows, vocab = (8192, 128256) if dev == "cuda" else (5, 1000)
logits = torch.randn(rows, vocab, device=dev, dtype=torch.bfloat16)
target = torch.randint(0, vocab, (rows,), device=dev)
ref = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")
ref_g = torch.softmax(logits.float(), -1)
ref_g[torch.arange(rows), target] -= 1
ref_g /= rows
sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 2
out = []
loss = torch.empty(rows, device=dev, dtype=torch.float32)
grad = torch.empty_like(logits)
def t(f):
    f()
    return bench(f).median_us if dev == "cuda" else float("nan")
# the current kernel, as fwd with grad runs it
chunk, warps = ce._launch_config(vocab, True)
n_valid = torch.tensor(rows, device=dev)
f = lambda: ce._cross_entropy_kernel[(rows,)](logits, vocab, target, 1, loss, grad, vocab, n_valid, vocab, -100, 0.0,
                                              HAS_SMOOTHING=False, WRITE_GRAD=True, MEAN=True, CHUNK=chunk, num_warps=warps)
us = t(f)
r = {"kernel": "current", "chunk": chunk, "warps": warps, "us": us, "pct_2n": 100 * 2 * logits.nbytes / us / 1e3 / copy,
     "err": (grad.float() - ref_g).abs().max().item()}
print(r, flush=True); out.append(r)
for per_sm in (1, 2, 3):
    for warps in (8, 16):
        for chunk in (2048, 4096, 8192):
            for stages in (1, 3, 4):
                grid = (min(rows, sms * per_sm),)
                f = lambda: cv.ce_persistent[grid](logits, target, loss, grad, rows, vocab, 1.0 / rows, CHUNK=chunk,
                                                   STAGES=stages, num_warps=warps)
                try:
                    us = t(f)
                    r = {"kernel": "persistent", "per_sm": per_sm, "warps": warps, "chunk": chunk, "stages": stages, "us": us,
                         "pct_2n": 100 * 2 * logits.nbytes / us / 1e3 / copy,
                         "err": max((grad.float() - ref_g).abs().max().item(), (loss - ref).abs().max().item() / 100)}
                except Exception as e:
                    r = {"kernel": "persistent", "per_sm": per_sm, "warps": warps, "chunk": chunk, "stages": stages,
                         "error": repr(e)[:200]}
                print(r, flush=True); out.append(r)
if len(sys.argv) > 1:
    json.dump(out, open(sys.argv[1], "w"), indent=1)
