"""A/B in one process: gate/up stored as (gate, up) row pairs, whose one-row step runs the norm, projection and
SwiGLU as one GEMV (as built by fold_norms), against the layout before (in-major [gate | up]: cuBLAS, then the
SwiGLU with h's 1 / rms), same weights, each variant recapturing the decode graphs.

Usage: ab_pairs.py PRESET BATCH ROUNDS VARIANT [VARIANT ...]   VARIANT: "paired" or "split"
Prints one JSON line per variant, with whether its greedy tokens equal the first variant's."""
import json
import sys
import time

import torch
from torch import nn

from fuselab.bench.decode import BLOCK_SIZE, _prompts, build_llm
from fuselab.bench.decode_rounds import decode_rate
from fuselab.engine import SamplingParams
from fuselab.engine.cuda_graphs import DecodeGraphs
from fuselab.engine.model import GRAPH_OPS


@torch.no_grad()
def set_layout(model, paired: bool, paired_ops) -> None:
    for layer in model.model.layers:
        proj = layer.mlp.gate_up_proj
        is_paired = proj.weight.stride()[1] == 1
        if is_paired == paired:
            continue
        w = proj.weight
        if paired:
            gate, up = w.chunk(2)
            proj.weight = nn.Parameter(torch.stack((gate, up), 1).flatten(0, 1))
        else:
            pairs = w.unflatten(0, (-1, 2))
            proj.weight = nn.Parameter(torch.cat((pairs[:, 0], pairs[:, 1])).t().contiguous().t())
        torch.cuda.empty_cache()
    ops = paired_ops if paired else GRAPH_OPS
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops


def main() -> None:
    preset, batch, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    variants = sys.argv[4:]
    prompt_len, new = 128, (256 if batch == 1 else 128)
    start = time.perf_counter()
    blocks_per_seq = -(-(prompt_len + new + 1) // BLOCK_SIZE) + 1
    llm = build_llm(preset, "graphs", batch, prompt_len + new + 2 * BLOCK_SIZE, BLOCK_SIZE * batch * blocks_per_seq,
                    None)
    prompts = _prompts(batch, prompt_len, llm.config.vocab_size)
    runner, model = llm.runner, llm.model
    paired_ops = model.ops
    assert model.norms_folded and paired_ops.rms_gate_up_swiglu is not GRAPH_OPS.rms_gate_up_swiglu
    build_s = time.perf_counter() - start

    def generate(n):
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t, outs

    reference = None
    for variant in variants:
        set_layout(model, {"paired": True, "split": False}[variant], paired_ops)
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
        print(json.dumps({"variant": variant, "preset": preset, "batch": batch, "new_tokens": new,
                          "rates": [round(r, 2) for r in rates], "median": round(sorted(rates)[len(rates) // 2], 2),
                          "same_tokens": tokens == reference, "capture_s": round(capture_s, 1),
                          "build_s": round(build_s, 1)}), flush=True)


if __name__ == "__main__":
    main()
