"""Decode tok/s of one engine build (graphs mode): warm-up, then rounds of T(1), T(new)."""
import json, sys, time
import torch
from fuselab.bench.decode import BLOCK_SIZE, _prompts, build_llm
from fuselab.bench.decode_rounds import decode_rate
from fuselab.engine import SamplingParams

preset, quant, batch, rounds, label = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
new, prompt = 256, 128
t0 = time.perf_counter()
llm = build_llm(preset, "graphs", batch, prompt + new + 2 * BLOCK_SIZE,
                BLOCK_SIZE * batch * (-(-(prompt + new + 1) // BLOCK_SIZE) + 1), None if quant == "bf16" else quant)
prompts = _prompts(batch, prompt, llm.config.vocab_size)

def gen(n):
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t

gen(new)
build = time.perf_counter() - t0
rates = []
for _ in range(rounds):
    one = gen(1); full = gen(new)
    rates.append(decode_rate(batch, new, one, full))
rates_sorted = sorted(rates)
print(json.dumps({"label": label, "preset": preset, "quant": quant, "batch": batch, "rates": [round(r, 2) for r in rates],
                  "median": round(rates_sorted[len(rates) // 2], 2), "build_s": round(build, 1)}), flush=True)
