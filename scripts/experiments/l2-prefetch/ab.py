"""A/B in one process: the decode step with weights prefetched into L2 on a side stream during the short kernels.

Usage: ab.py PRESET FORMAT BATCH ROUNDS VARIANT [VARIANT ...]   (FORMAT bf16 or a quantization)
VARIANT: "off", or four budgets in MB "a,b,c,d": bytes prefetched after the q/k/v projection (output projection's
weight, then gate/up's), after the output projection (gate/up, on from there), after gate/up (down's), after down
(the next layer's q/k/v). Each variant recaptures the decode graphs; prints one JSON line per variant."""
import json
import sys
import time

import torch

from fuselab.bench.decode import BLOCK_SIZE, _prompts, build_llm
from fuselab.bench.decode_rounds import decode_rate
from fuselab.engine import SamplingParams
from fuselab.engine.cuda_graphs import DecodeGraphs
from fuselab.engine.quantize import QuantizedLinear
from fuselab.kernels.l2_prefetch import prefetch_l2

MB = 1 << 20


def storage(module) -> torch.Tensor:
    return module.weight.data if isinstance(module, QuantizedLinear) else module.weight


def take(queue: list[list], budget: int) -> list[tuple]:
    """Ranges of up to `budget` bytes from the front of queue ([tensor, start] items), advancing it."""
    out = []
    while budget > 0 and queue:
        t, start = queue[0]
        total = t.numel() * t.element_size()
        n = min(budget, total - start)
        out.append((t, start, n))
        budget -= n
        if start + n >= total:
            queue.pop(0)
        else:
            queue[0][1] = start + n
    return out


def plans(model, budgets: list[int]) -> list[list[list[tuple]]]:
    layers = model.model.layers
    result = []
    for i, layer in enumerate(layers):
        sa, mlp = layer.self_attn, layer.mlp
        attn_q = [[storage(sa.o_proj), 0], [storage(mlp.gate_up_proj), 0]]
        w1 = take(attn_q, budgets[0])
        w2 = take(attn_q, budgets[1])
        w3 = take([[storage(mlp.down_proj), 0]], budgets[2])
        w4 = take([[storage(layers[i + 1].self_attn.qkv_proj), 0]], budgets[3]) if i + 1 < len(layers) else []
        result.append([w1, w2, w3, w4])
    return result


def install(model, budgets: list[int] | None, side: torch.cuda.Stream) -> None:
    """Each layer's forward with the prefetches forked at its four points (budgets None: the plain forward)."""
    layers = model.model.layers
    for layer in layers:
        layer.__dict__.pop("forward", None)
    model.__dict__.pop("greedy", None)
    if budgets is None:
        return
    layer_plans = plans(model, budgets)

    def fork(ranges):
        if not ranges:
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for t, start, n in ranges:
                prefetch_l2(t, start, n)

    def make(layer, plan):
        plain = type(layer).forward.__get__(layer)
        sa, mlp = layer.self_attn, layer.mlp

        def forward(x, residual, attn):
            if attn.is_prefill or sa.rope_decode_attention is None:
                return plain(x, residual, attn)
            ops = sa.ops
            h, residual = layer.input_layernorm.add_and_normalize(x, residual)
            qkv = ops.linear(h, sa.qkv_proj.weight, sa.qkv_proj.bias)
            fork(plan[0])
            o = sa.rope_decode_attention(qkv, attn.block_tables, attn.seq_lens)
            h = sa._output(o, h.shape[0])
            fork(plan[1])
            h, residual = layer.post_attention_layernorm.add_and_normalize(h, residual)
            gate_up = ops.linear(h, mlp.gate_up_proj.weight)
            fork(plan[2])
            out = ops.linear(_silu_and_mul(gate_up), mlp.down_proj.weight)
            fork(plan[3])
            return out, residual
        return forward

    from fuselab import kernels
    _silu_and_mul = kernels.silu_and_mul
    for layer, plan in zip(layers, layer_plans):
        layer.forward = make(layer, plan)
    plain_greedy = type(model).greedy.__get__(model)

    def greedy(logits):
        out = plain_greedy(logits)
        torch.cuda.current_stream().wait_stream(side)  # the side stream joins before the step ends
        return out
    model.greedy = greedy


def main() -> None:
    preset, fmt, batch, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    variants = sys.argv[5:]
    prompt_len, new = 128, 256
    start = time.perf_counter()
    blocks_per_seq = -(-(prompt_len + new + 1) // BLOCK_SIZE) + 1
    llm = build_llm(preset, "graphs", batch, prompt_len + new + 2 * BLOCK_SIZE, BLOCK_SIZE * batch * blocks_per_seq,
                    None if fmt == "bf16" else fmt)
    prompts = _prompts(batch, prompt_len, llm.config.vocab_size)
    runner, model = llm.runner, llm.model
    side = torch.cuda.Stream(llm.device)
    build_s = time.perf_counter() - start

    def generate(n):
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t, outs

    reference = None
    for variant in variants:
        budgets = None if variant == "off" else [int(float(b) * MB) for b in variant.split(",")]
        install(model, budgets, side)
        t = time.perf_counter()
        runner.graphs = DecodeGraphs(runner._graph_step, runner.graphs.buckets, llm.device)
        runner.graphs.capture()
        capture_s = time.perf_counter() - t
        _, outs = generate(new)
        tokens = [o.token_ids if hasattr(o, "token_ids") else o["token_ids"] for o in outs]
        if reference is None:
            reference = tokens
        rates = [decode_rate(batch, new, generate(1)[0], generate(new)[0]) for _ in range(rounds)]
        print(json.dumps({"variant": variant, "preset": preset, "format": fmt, "batch": batch,
                          "rates": [round(r, 2) for r in rates], "median": round(sorted(rates)[len(rates) // 2], 2),
                          "same_tokens": tokens == reference, "capture_s": round(capture_s, 1),
                          "build_s": round(build_s, 1)}), flush=True)


if __name__ == "__main__":
    main()
