"""A/B in one process: a one-row decode step with the norms folded (no norm kernel) against the norm kernels.

Usage: ab.py PRESET[:QUANTIZATION] BATCH ROUNDS VARIANT [VARIANT ...]
VARIANT: "folded" (model.norms_folded = True: DecoderLayer.forward_folded) or "norms" (False: the add + RMSNorm
kernels, over the same folded weights, whose norms then have weights of ones; a quantized model's weights are
not folded: its one-row kernels take the norm's weight). Each variant recaptures the decode
graphs; prints one JSON line per variant, with whether its greedy tokens equal the first variant's."""
import json
import sys
import time

import torch

from fuselab.bench.decode import BLOCK_SIZE, _prompts, build_llm
from fuselab.bench.decode_rounds import decode_rate
from fuselab.engine import SamplingParams
from fuselab.engine.cuda_graphs import DecodeGraphs


def main() -> None:
    preset, _, quantization = sys.argv[1].partition(":")
    batch, rounds = int(sys.argv[2]), int(sys.argv[3])
    variants = sys.argv[4:]
    prompt_len, new = 128, 256
    start = time.perf_counter()
    blocks_per_seq = -(-(prompt_len + new + 1) // BLOCK_SIZE) + 1
    llm = build_llm(preset, "graphs", batch, prompt_len + new + 2 * BLOCK_SIZE, BLOCK_SIZE * batch * blocks_per_seq,
                    quantization or None)
    prompts = _prompts(batch, prompt_len, llm.config.vocab_size)
    runner = llm.runner
    build_s = time.perf_counter() - start
    assert llm.model.norms_folded

    def generate(n):
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t, outs

    reference = None
    for variant in variants:
        llm.model.norms_folded = {"folded": True, "norms": False}[variant]
        t = time.perf_counter()
        runner.graphs = DecodeGraphs(runner._graph_step, runner.graphs.buckets, llm.device)
        with torch.inference_mode():
            runner.graphs.capture()
        capture_s = time.perf_counter() - t
        _, outs = generate(new)
        tokens = [o.token_ids for o in outs]
        if reference is None:
            reference = tokens
        rates = [decode_rate(batch, new, generate(1)[0], generate(new)[0]) for _ in range(rounds)]
        print(json.dumps({"variant": variant, "preset": preset, "format": quantization or "bf16", "batch": batch,
                          "rates": [round(r, 2) for r in rates], "median": round(sorted(rates)[len(rates) // 2], 2),
                          "same_tokens": tokens == reference, "capture_s": round(capture_s, 1),
                          "build_s": round(build_s, 1)}), flush=True)


if __name__ == "__main__":
    main()
