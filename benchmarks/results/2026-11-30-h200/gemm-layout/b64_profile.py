"""Kernel time of one 8B batch-64 graphs decode step, by kernel name, at context ~256."""
import collections, json, os, sys, torch
from torch.profiler import profile, ProfilerActivity
from fuselab.bench.decode import build_llm, engine_step, _prompts

batch, prompt = 64, int(os.environ.get("PROMPT", "256"))
llm = build_llm("llama3-8b", "graphs", batch, prompt + 128 + 16, 16 * batch * (-(-(prompt + 160) // 16) + 1))
prompts = _prompts(batch, prompt, llm.config.vocab_size)
with engine_step(llm, prompts, max_tokens=100) as step:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    steps = 4
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
agg = collections.defaultdict(lambda: [0, 0.0])
first = last = None
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        agg[e.name][0] += 1
        agg[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        t0 = e.time_range.start; t1 = e.time_range.end
        first = t0 if first is None else min(first, t0); last = t1 if last is None else max(last, t1)
rows = sorted(((n, c / steps, t / steps) for n, (c, t) in agg.items()), key=lambda r: -r[2])
total = sum(r[2] for r in rows)
print(f"context ~{prompt}; kernel time per step {total:.0f} us; span per step {(last - first) / steps:.0f} us")
for n, c, t in rows[:40]:
    print(f"{t:9.1f} us {c:6.1f}x {t / total * 100:5.1f}%  {n[:150]}")
json.dump({"prompt": prompt, "rows": rows}, open(sys.argv[1], "w"), indent=1)
