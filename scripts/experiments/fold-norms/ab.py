"""A/B in one process: one-row decode steps of one model, over the same weights, each variant recapturing the
decode graphs.

Usage: ab.py PRESET[:QUANTIZATION] BATCH ROUNDS VARIANT [VARIANT ...]
VARIANT:
- "folded": as built (model.norms_folded = True: DecoderLayer.forward_folded; a float model's gate/up as (gate, up)
  row pairs, whose one-row step runs the norm, the projection and the SwiGLU as one GEMV);
- "norms": the add + RMSNorm kernels (norms_folded = False) over the same folded weights, whose norms then have
  weights of ones; a quantized model's weights are not folded: its one-row kernels take the norm's weight;
- "split": folded, with a float model's gate/up back in the layout before the pairs (in-major [gate | up]: cuBLAS,
  then the SwiGLU with h's 1 / rms);
- "ends-old": folded, with the step's ends as before the one-launch ends: torch's where / index / cast / lookup
  for the input rows, the final RMSNorm kernel before the logits projection (cuBLAS, or the quantized kernels),
  the argmax into a fresh tensor copied into the step's token buffer; "logits-old" and "embed-old": only the
  logits' or only the input rows' part of it.
A variant may end in "@pair=ROWS,BLOCK_K,WARPS" (the paired gate/up GEMV's tile) or "@head=ROWS,BLOCK_K,WARPS" (the
logits GEMV's, a weight of 65,536 rows or more), the launch only: the weights stay as they are.
Batch 1 decodes 256 new tokens, larger batches 128. Prints one JSON line per variant, with whether its greedy
tokens equal the first variant's."""
import functools
import importlib
import json
import sys
import time

import torch
from torch import nn

from fuselab.bench.decode import BLOCK_SIZE, _prompts, build_llm
from fuselab.bench.decode_rounds import decode_rate
from fuselab.engine import SamplingParams
from fuselab.engine.cuda_graphs import DecodeGraphs
from fuselab import kernels
from fuselab.engine.model import GRAPH_OPS
from fuselab.kernels import QuantizedWeight, reference
gemv = importlib.import_module("fuselab.kernels.linear")  # the module: fuselab.kernels.linear is the op

# The step before the pairs: cuBLAS over in-major [gate | up], then the SwiGLU with h's 1 / rms.
SPLIT_OPS = GRAPH_OPS._replace(
    rms_gate_up_swiglu=lambda h, w, eps, g: kernels.rms_silu_and_mul(kernels.linear(h, w), h, eps))


def _old_logits(h, w, eps, g, out):
    normed = kernels.rms_norm(h, g, eps)
    if isinstance(w, QuantizedWeight):
        return kernels.quantized_linear(normed, w, None, out)
    return torch.matmul(normed, w.t(), out=out)


_BUILT_LAUNCHER = gemv._gemv_launcher.__wrapped__


def set_gemv_tiles(pair: tuple | None, head: tuple | None) -> None:
    """The float GEMV's launches with the paired gate/up's tile `pair` and the logits' `head` where given."""
    @functools.cache
    def launcher(n, k, has_bias, has_residual, rms_scale, norm_weight, swiglu, pdl):
        blocks, pair_blocks, warps = gemv.gemv_blocks, gemv.gemv_pair_blocks, gemv.NUM_WARPS
        if swiglu and pair:
            gemv.gemv_pair_blocks = lambda k: pair
        if not swiglu and head and n >= 65536:
            gemv.gemv_blocks, gemv.NUM_WARPS = (lambda k: head[:2]), head[2]
        try:
            return _BUILT_LAUNCHER(n, k, has_bias, has_residual, rms_scale, norm_weight, swiglu, pdl)
        finally:
            gemv.gemv_blocks, gemv.gemv_pair_blocks, gemv.NUM_WARPS = blocks, pair_blocks, warps
    gemv._gemv_launcher = launcher


def ends_ops(ops, variant: str):
    """The top-level model's ops with the step's ends of `variant` (see the module's docstring)."""
    if variant in ("ends-old", "logits-old"):
        ops = ops._replace(rms_logits=_old_logits,
                           argmax=lambda logits, counters, out: kernels.argmax(logits, counters=counters) if out is None
                           else out.copy_(kernels.argmax(logits, counters=counters)))
    if variant in ("ends-old", "embed-old"):
        ops = ops._replace(decode_embedding=reference.decode_embedding)
    return ops


@torch.no_grad()
def set_gate_up_layout(model, paired: bool, paired_ops) -> None:
    """A float model's gate/up weights as (gate, up) row pairs with `paired_ops`, or in-major [gate | up] with
    SPLIT_OPS; a quantized model's stay as they are."""
    if not isinstance(model.model.layers[0].mlp.gate_up_proj, nn.Linear):
        return
    for layer in model.model.layers:
        proj = layer.mlp.gate_up_proj
        if (proj.weight.stride()[1] == 1) == paired:
            continue
        w = proj.weight
        if paired:
            gate, up = w.chunk(2)
            proj.weight = nn.Parameter(torch.stack((gate, up), 1).flatten(0, 1))
        else:
            pairs = w.unflatten(0, (-1, 2))
            proj.weight = nn.Parameter(torch.cat((pairs[:, 0], pairs[:, 1])).t().contiguous().t())
        torch.cuda.empty_cache()
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = paired_ops if paired else SPLIT_OPS


def main() -> None:
    preset, _, quantization = sys.argv[1].partition(":")
    batch, rounds = int(sys.argv[2]), int(sys.argv[3])
    variants = sys.argv[4:]
    prompt_len, new = 128, (256 if batch == 1 else 128)
    start = time.perf_counter()
    blocks_per_seq = -(-(prompt_len + new + 1) // BLOCK_SIZE) + 1
    llm = build_llm(preset, "graphs", batch, prompt_len + new + 2 * BLOCK_SIZE, BLOCK_SIZE * batch * blocks_per_seq,
                    quantization or None)
    prompts = _prompts(batch, prompt_len, llm.config.vocab_size)
    runner, model = llm.runner, llm.model
    built_ops = model.ops
    build_s = time.perf_counter() - start
    assert model.norms_folded

    def generate(n):
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t, outs

    reference = None
    for name in variants:
        variant, *tiles = name.split("@")
        tiles = dict(t.split("=") for t in tiles)
        set_gemv_tiles(*(tuple(int(v) for v in tiles[key].split(",")) if key in tiles else None
                         for key in ("pair", "head")))
        model.norms_folded = variant != "norms"
        set_gate_up_layout(model, variant != "split", built_ops)
        model.ops = ends_ops(model.model.layers[0].ops, variant)
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
        print(json.dumps({"variant": name, "preset": preset, "format": quantization or "bf16", "batch": batch,
                          "new_tokens": new, "rates": [round(r, 2) for r in rates],
                          "median": round(sorted(rates)[len(rates) // 2], 2), "same_tokens": tokens == reference,
                          "capture_s": round(capture_s, 1), "build_s": round(build_s, 1)}), flush=True)


if __name__ == "__main__":
    main()
