"""`fuselab bench decode`'s output: the Markdown page, the plot and the console tables of a result."""

from __future__ import annotations

from pathlib import Path

from fuselab.bench import decode_quant, fmt

BREAKDOWN = ("compute", "memory", "launch_gaps", "sync_stalls", "other_idle")

COLUMNS = ["mode", "batch", "decode tok/s", "bandwidth achieved", "rounds min-max", "vs hf", "first generate tok/s",
           "TTFT ms", "ITL p50 ms", "ITL p99 ms", "kernels/step", "compile/capture s", "weights GB", "vs bf16"]
DOCTOR_COLUMNS = ["mode", "verdict", "step us", "kernels", "syncs", "GPU busy",
                  *(f"{p.replace('_', ' ')}" for p in BREAKDOWN)]


def _label(row: dict) -> str:
    """A row's mode, and its weights' format when quantized ("graphs int4")."""
    quantization = row.get("quantization", "bf16")
    return row["mode"] if quantization == "bf16" else f"{row['mode']} {quantization}"


def _spread(row: dict) -> str:
    """The rounds' range of a row's rate."""
    if row.get("decode_tok_s_min") is None:
        return "—"
    return f"{row['decode_tok_s_min']:.1f}-{row['decode_tok_s_max']:.1f}"


def _vs_hf(row: dict) -> str:
    """A row's rate over hf's: measured in turns, the median of per-round ratios and their range;
    measured apart, the ratio of medians (starred)."""
    if row.get("vs_hf") is None:
        return "—"
    if "vs_hf_rounds" not in row:
        return f"{row['vs_hf']:.2f}x*"
    return f"{row['vs_hf']:.2f}x ({row['vs_hf_min']:.2f}-{row['vs_hf_max']:.2f})"


def _table_rows(result: dict) -> list[list[str]]:
    rows = result["rows"]
    return [[_label(r), str(r["batch"]), fmt(r["decode_tok_s"], ".1f"), fmt(r["bandwidth_pct"], ".0f") + "%",
             _spread(r), _vs_hf(r), fmt(r.get("first_generate_tok_s"), ".1f"), fmt(r["ttft_ms"], ".1f"), fmt(r["itl_p50_ms"], ".2f"), fmt(r["itl_p99_ms"], ".2f"),
             fmt(r["kernels_per_step"], ".0f"), fmt(r["compile_s"], ".1f"), fmt(r.get("weights_gb"), ".2f"),
             decode_quant.vs_bf16(r, rows)] for r in rows]



def _doctor_rows(result: dict) -> list[list[str]]:
    out = []
    for mode, d in result["doctor"].items():
        parts = [f"{d['breakdown'][p]['us']:.0f} us ({100 * d['breakdown'][p]['share']:.0f}%)" for p in BREAKDOWN]
        out.append([mode, d["verdict"], f"{d['wall_us_per_step']:.0f}", f"{d['kernels_per_step']:.0f}",
                    f"{d['syncs_per_step']:g}", f"{d['gpu_busy_pct']:.0f}%", *parts])
    return out


def _describe(result: dict) -> str:
    c = result["config"]
    formats = "".join(f", {q}" for q in c.get("quantization", []))
    rounds = f", median of {c['rounds']} rounds" if "rounds" in c else ""
    return (f"{c['preset']}, bf16{formats}, random weights, prompt {c['prompt_len']}, {c['new_tokens']} new tokens, "
            f"greedy{rounds}; "
            f"roofline: {c['weight_bytes'] / 1e9:.2f} GB of weights + KV at mean context {c['mean_context']:.0f} "
            f"per step at {c['copy_bandwidth_gbs'] / 1e3:.2f} TB/s ({c['ceilings_source']})")


def write_markdown(result: dict, path: Path) -> None:
    h, d = result["header"], result["header"]["device"]
    lines = [
        "# fuselab bench decode", "",
        f"- date: {h['date']}",
        f"- GPU: {d['name']} (torch {d['torch']}, triton {d['triton']}, CUDA {d['cuda']}, Python {d['python']})",
        f"- command: `{h['command']}`",
        f"- workload: {_describe(result)}",
        "- decode tok/s = batch · (new − 1) / (T(new) − T(1)), T(n) the wall time of one whole generate of n tokens "
        "a sequence (transformers: a plain `model.generate`, no streamer; the engine: `LLM.generate`), the median "
        "of the rounds after a warm-up generate; rounds min-max: their range; vs hf: the rate over hf's, as the "
        "median of per-round ratios with their range for the modes measured in turns with hf "
        f"({', '.join(result['config'].get('interleaved', [])) or 'none in this run'}), and as the ratio of medians "
        "(*) for the others; first generate tok/s: the warm-up's rate, the first pass over these context lengths "
        "(hf-compile: its compilation); TTFT and ITL: from one more generate, streamed (transformers) or from the "
        "requests' metrics (the engine); bandwidth achieved = decode tok/s over "
        "the roofline's (a quantized row's counts what its step reads: packed projections and norms, not an untied "
        "embedding table, which the bf16 rows' counts); compile/capture s: torch.compile's "
        "first generate per batch size (hf-compile), CUDA-graph capture of every bucket (graphs); weights GB: the "
        "engine's weights on the GPU; vs bf16: a quantized row's rate over its mode's bf16 row", "",
        "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * 1 + "---:|" * (len(COLUMNS) - 1),
        *["| " + " | ".join(row) + " |" for row in _table_rows(result)],
    ]
    lines += [f"- {mode} failed, so it has no rows (or only those before the failure): {err}"
              for mode, err in result.get("failed", {}).items()]
    patched = next((r["logits_vs_hf"] for r in result["rows"] if "logits_vs_hf" in r), None)
    if patched:
        lines.append(f"- hf-patch's logits on the prompt against hf's: largest difference "
                     f"{patched['max_rel_diff']:.2e} of the largest logit, same top token at "
                     f"{100 * patched['argmax_agreement']:.1f}% of positions")
    lines += decode_quant.quality_markdown(result)
    if result["doctor"]:
        lines += ["", f"## The doctor on one decode step, batch {result['config']['doctor_batch']}", "",
                  "| " + " | ".join(DOCTOR_COLUMNS) + " |", "|---|---|" + "---:|" * (len(DOCTOR_COLUMNS) - 2),
                  *["| " + " | ".join(row) + " |" for row in _doctor_rows(result)]]
        lines += [f"- {mode}: {d['first_fix']}" for mode, d in result["doctor"].items() if d["first_fix"]]
    path.write_text("\n".join(lines) + "\n")


def write_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(_label(r) for r in result["rows"]))
    batches = result["config"]["batch_sizes"]
    fig, (rates, shares) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        rows = {r["batch"]: r for r in result["rows"] if _label(r) == mode}
        xs = [j + i * width for j in range(len(batches))]
        heights = [rows[b]["decode_tok_s"] or 0 if b in rows else 0 for b in batches]
        # The rounds' range as error bars, where the row has one.
        low = [h - (rows[b].get("decode_tok_s_min") or h) if b in rows else 0 for b, h in zip(batches, heights)]
        high = [(rows[b].get("decode_tok_s_max") or h) - h if b in rows else 0 for b, h in zip(batches, heights)]
        rates.bar(xs, heights, width, yerr=[low, high], capsize=2, label=mode)
        shares.bar(xs, [rows[b]["bandwidth_pct"] or 0 if b in rows else 0 for b in batches], width, label=mode)
    for ax, label in ((rates, "decode tok/s"), (shares, "bandwidth achieved, % of roofline")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set(ylabel=label, title=f"{result['config']['preset']} on {result['header']['device']['name']}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    shares.axhline(100, color="gray", linestyle="--", linewidth=1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 230)  # a pipe reports 80 columns, which would cut the table's cells
    tables = [(f"fuselab bench decode: {_describe(result)}", COLUMNS, _table_rows(result), ("mode",))]
    if result["doctor"]:
        tables.append((f"the doctor on one decode step, batch {result['config']['doctor_batch']}", DOCTOR_COLUMNS,
                       _doctor_rows(result), ("mode", "verdict")))
    for title, columns, rows, left in tables:
        table = Table(title=title)
        for col in columns:
            table.add_column(col, justify="left" if col in left else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    decode_quant.print_quality(console, result)
    for mode, err in result.get("failed", {}).items():
        console.print(f"[red]{mode} failed:[/] {err}")
