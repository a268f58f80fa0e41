"""Paged decode attention at batch 64 and short contexts (the engine's batch-64 bench) against the
configs and split counts, with longer contexts as guard rails. Timed as `fuselab bench attention`."""
import json, sys, torch
from fuselab.bench.attention import paged_workloads, decode_us, decode_bytes, DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM
from fuselab.kernels import paged_attention
from fuselab.kernels.paged_attention import DecodeConfig

timing = {"warmup_ms": 5, "rep_ms": 25}
COPY = 4242.0
WORK = [(64, 128), (64, 256), (64, 384), (64, 4096), (8, 4096), (8, 512), (1, 4096)]
CONFIGS = [DecodeConfig(n, w, s) for n in (16, 32, 64) for w in (1, 2, 4) for s in (2, 3, 4)]
orig = paged_attention.DECODE_CONFIGS[128]
res = []
for batch, ctx in WORK:
    ws = paged_workloads(batch, ctx, torch.bfloat16)
    nbytes = decode_bytes(batch, ctx, DECODE_HEADS, DECODE_KV_HEADS, DECODE_HEAD_DIM, 2)
    default_splits = paged_attention.num_splits(batch, DECODE_KV_HEADS, ctx, 32, torch.device("cuda"))
    split_opts = sorted({1, 2, default_splits}) if batch == 64 else [default_splits]
    for cfg in CONFIGS:
        paged_attention.DECODE_CONFIGS[128] = cfg
        for splits in split_opts:
            fn = lambda q, k_cache, v_cache, block_tables, seq_lens, s=splits: paged_attention.decode_launch(
                q, k_cache, v_cache, block_tables, seq_lens, 128**-0.5, s)
            try:
                us = decode_us(fn, ws, timing)
            except Exception as e:
                print(batch, ctx, cfg, splits, "failed", type(e).__name__); continue
            r = dict(batch=batch, context=ctx, config=list(cfg), splits=splits, us=us,
                     pct=100 * nbytes / us / 1e3 / COPY, current=(cfg == orig and splits == default_splits))
            res.append(r)
    paged_attention.DECODE_CONFIGS[128] = orig
    rows = sorted([r for r in res if r["batch"] == batch and r["context"] == ctx], key=lambda r: r["us"])
    cur = [r for r in rows if r["current"]]
    print(f"batch {batch} context {ctx}: current {cur[0]['config'] if cur else None} splits {default_splits} "
          f"{cur[0]['us'] if cur else float('nan'):.2f} us ({cur[0]['pct'] if cur else 0:.0f}%)", flush=True)
    for r in rows[:6]:
        print(f"   {r['config']} splits {r['splits']}: {r['us']:.2f} us {r['pct']:.0f}%", flush=True)
    del ws
    torch.cuda.empty_cache()
json.dump(res, open(sys.argv[1], "w"), indent=1)
