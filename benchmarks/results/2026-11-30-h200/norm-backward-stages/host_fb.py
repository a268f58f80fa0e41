"""Host time of forward+backward at decode size: where does it go?"""
import cProfile, pstats, io, sys, time, statistics
import torch
from fuselab import kernels
from fuselab.kernels import reference
from fuselab.bench.kernels import ops, forward_backward_step, forward_step, host_us_per_call

dev = torch.device("cuda")
lines = []
for op in ops():
    if op.name not in ("rms_norm", "softmax", "swiglu", "rope", "layer_norm", "cross_entropy", "bias_act"):
        continue
    wl = op.sizes["decode"](torch.bfloat16, dev)
    for impl, fn in (("ours", op.ours), ("eager", op.eager)):
        f = forward_step(fn, wl)
        leaves = [a.detach().requires_grad_(True) if i in wl.grad_args else a for i, a in enumerate(wl.args)]
        fg = lambda: fn(*leaves)
        fb = forward_backward_step(fn, wl)
        lines.append(f"{op.name:14s} {impl:6s} fwd {host_us_per_call(f):7.1f}  fwd(grad) {host_us_per_call(fg):7.1f}  fwd+bwd {host_us_per_call(fb):7.1f} us")
        print(lines[-1], flush=True)
    if op.name in ("rms_norm", "rope", "softmax"):
        fb = forward_backward_step(op.ours, wl)
        for _ in range(20):
            fb()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            fb()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        lines.append(f"--- cProfile {op.name} fwd+bwd x200 ---\n" + s.getvalue())
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
