"""Where a fused-mode decode step's host time goes (1B shape, batch 1)."""
import cProfile, pstats, io, sys, time, statistics
import torch
from fuselab.bench.decode import build_llm
from fuselab.engine import SamplingParams

out = sys.argv[1]
llm = build_llm("llama3-1b", "fused", 1, 512, 512)
prompt = [list(range(1, 129))]
sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
llm.generate(prompt, sp(32))
torch.cuda.synchronize()

def gen_s(n):
    torch.cuda.synchronize(); t = time.perf_counter(); llm.generate(prompt, sp(n)); torch.cuda.synchronize()
    return time.perf_counter() - t
per_tok = []
for _ in range(3):
    per_tok.append((gen_s(129) - gen_s(1)) / 128 * 1e3)
lines = [f"generate: ms per decode token {[round(x, 3) for x in per_tok]}"]

# The forward alone, on staged inputs of one row (a sequence at position 200).
runner = llm.runner
from fuselab.engine.runner import DecodeInputs
with torch.inference_mode():
    inputs = runner._stage_decode([], 1)
    torch.cuda.synchronize()
    for _ in range(5): runner.decode_forward(inputs)
    samples = []
    for _ in range(5):
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(50): runner.decode_forward(inputs)
        t1 = time.perf_counter(); torch.cuda.synchronize()
        samples.append((t1 - t) / 50 * 1e3)
    lines.append(f"decode_forward host ms (no sync inside): {[round(x, 3) for x in samples]}")
    # the forward's pieces: layers only
    model = runner.model
    from fuselab.kernels import dependent_launches
    from fuselab.engine.model import AttentionMetadata
    ids = torch.zeros(1, dtype=torch.int64, device="cuda")
    attn = AttentionMetadata(is_prefill=False, positions=inputs.positions, slot_mapping=inputs.slot_mapping,
                             block_tables=inputs.block_tables, seq_lens=inputs.seq_lens)
    layer = model.model.layers[0]
    h = torch.zeros(1, 2048, dtype=torch.bfloat16, device="cuda"); r = h.clone()
    def timeit(fn, n=200):
        s = []
        for _ in range(5):
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(n): fn()
            t1 = time.perf_counter(); torch.cuda.synchronize(); s.append((t1 - t) / n * 1e6)
        return round(statistics.median(s), 1)
    with dependent_launches():
        lines.append(f"one layer us: {timeit(lambda: layer.forward(h, r, attn))}")
        lines.append(f"attention us: {timeit(lambda: layer.self_attn.forward(h, attn))}")
        lines.append(f"mlp us: {timeit(lambda: layer.mlp.forward(h))}")
        lines.append(f"norm+res us: {timeit(lambda: layer.input_layernorm.add_and_normalize(h, r))}")
        lines.append(f"logits us: {timeit(lambda: model.compute_logits(h, r))}")
        lg = model.compute_logits(h, r)
        lines.append(f"greedy us: {timeit(lambda: model.greedy(lg))}")
    lines.append(f"embed us: {timeit(lambda: model.model.embed_tokens(ids))}")
    lines.append(f"where+index us: {timeit(lambda: torch.where(inputs.input_ids >= 0, inputs.input_ids, runner.last_tokens[inputs.prev_rows]))}")

pr = cProfile.Profile()
pr.enable()
llm.generate(prompt, sp(129))
pr.disable()
s = io.StringIO()
ps = pstats.Stats(pr, stream=s); ps.sort_stats("tottime").print_stats(45)
ps.sort_stats("cumulative").print_stats(45)
open(out, "w").write("\n".join(lines) + "\n\n" + s.getvalue())
print("\n".join(lines))
