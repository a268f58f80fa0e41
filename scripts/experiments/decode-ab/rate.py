"""Decode tok/s of the engine build on PYTHONPATH: one warm-up generate, then rounds of T(1) and T(new).
Usage: rate.py PRESET FORMAT BATCH ROUNDS LABEL   (FORMAT bf16 or a quantization); prints one JSON line."""
import json
import sys
import time

from fuselab.bench.decode import BLOCK_SIZE, _prompts, build_llm
from fuselab.bench.decode_rounds import decode_rate
from fuselab.engine import SamplingParams

preset, fmt, batch, rounds, label = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
prompt_len, new = 128, 256
start = time.perf_counter()
blocks_per_seq = -(-(prompt_len + new + 1) // BLOCK_SIZE) + 1
llm = build_llm(preset, "graphs", batch, prompt_len + new + 2 * BLOCK_SIZE, BLOCK_SIZE * batch * blocks_per_seq,
                None if fmt == "bf16" else fmt)
prompts = _prompts(batch, prompt_len, llm.config.vocab_size)


def generate_s(n: int) -> float:
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t


generate_s(new)
build_s = time.perf_counter() - start
rates = [decode_rate(batch, new, generate_s(1), generate_s(new)) for _ in range(rounds)]
print(json.dumps({"label": label, "preset": preset, "format": fmt, "batch": batch, "rates": [round(r, 2) for r in rates],
                  "median": round(sorted(rates)[len(rates) // 2], 2), "build_s": round(build_s, 1)}), flush=True)
