"""The quantized rows of `fuselab bench decode --quantization int4,int8,fp8`: what a quantized
step reads, the GPU bytes of its weights, and the quality of its logits against bf16.

A quantized engine runs the same random weights as the bf16 one (drawn the same, then quantized),
so the two compare like for like. Its roofline counts what its step reads: every projection
(lm_head, or a tied model's quantized copy of the embedding, included) at its packed size, codes
plus scales, and the norms; not an untied embedding table, of which a step reads one row a token
(the bf16 rows' roofline counts that table too: 1.05 GB at the 8B shape, 7% of its bytes).
Quality: the bf16 engine decodes --new-tokens greedy tokens from one prompt; each format's engine
scores the same sequence (fuselab.engine.quant_quality): mean KL(bf16 || format) and top-1
agreement over the decoded positions.
"""

from __future__ import annotations

import argparse
import gc
import random
import traceback
from typing import Callable

import torch

from fuselab.bench import error_text
from fuselab.engine.cli import QUANTIZATION_CHOICES

# The engine modes a format is measured in: "eager" dequantizes every weight in torch at every
# step, which times torch rather than the format.
QUANTIZED_MODES = ("fused", "graphs")


def formats(text: str) -> list[str]:
    """An argparse type: comma-separated quantization formats, each once, in the order given."""
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [n for n in names if n not in QUANTIZATION_CHOICES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated formats among {', '.join(QUANTIZATION_CHOICES)}; "
                                         f"got {text!r}")
    return names


def step_bytes(model, bf16_bytes: int) -> int:
    """The weight bytes a quantized step reads, from the bf16 roofline's: each projection at its
    packed size, and no untied embedding table."""
    from fuselab.engine.quantize import quantized_layers

    layers = quantized_layers(model).values()
    dense = sum(2 * layer.in_features * layer.out_features for layer in layers)
    packed = sum(layer.qweight.nbytes + layer.scales.nbytes for layer in layers)
    table = 0 if model.config.tie_word_embeddings else 2 * model.model.embed_tokens.weight.numel()
    return bf16_bytes - dense + packed - table


def measure(args: argparse.Namespace, modes: list[str], rows: list[dict], doctor: dict, failed: dict,
            measure_mode: Callable, release: Callable[[], None]) -> dict:
    """Run `measure_mode(mode, args, rows, doctor, quantization)` for each --quantization format in
    each engine mode that takes one, then the quality of each format's logits (a failure costs its
    own rows, named in `failed`). Returns the quality results by format."""
    for quantization in args.quantization:
        for mode in (m for m in modes if m in QUANTIZED_MODES):
            label = f"{mode} {quantization}"
            print(f"{label}: building", flush=True)
            try:
                measure_mode(mode, args, rows, doctor, quantization)
            except Exception as err:  # noqa: BLE001
                failed[label] = error_text(err, limit=None)
                traceback.print_exc()
                print(f"{label} failed: {failed[label]}; going on with the other modes", flush=True)
            release()
    if not args.quantization:
        return {}
    print("quality of the quantized logits against bf16", flush=True)
    try:
        return quality(args.preset, args.quantization, args.prompt_len, args.new_tokens)
    except Exception as err:  # noqa: BLE001
        failed["quality"] = error_text(err, limit=None)
        traceback.print_exc()
        return {}


def quality(preset: str, quantizations: list[str], prompt_len: int, new_tokens: int) -> dict[str, dict]:
    """format -> {mean_kl, top1_agreement, positions} against bf16 over `new_tokens` decoded tokens."""
    from fuselab.engine import LLM, SamplingParams
    from fuselab.engine.quant_quality import compare, log_probs

    def engine(quantization):
        return LLM(preset, mode="fused", dtype="bfloat16", max_num_seqs=1, max_model_len=prompt_len + new_tokens + 16,
                   num_kv_blocks=-(-(prompt_len + new_tokens + 16) // 16), quantization=quantization)

    reference = engine(None)
    rng = random.Random(0)
    prompt = [rng.randrange(reference.config.vocab_size) for _ in range(prompt_len)]
    decoded = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    sequence = prompt + decoded[0].token_ids[:-1]  # the last token's own prediction is not compared
    expected = log_probs(reference.model, sequence)
    del reference
    _release()
    results = {}
    for name in quantizations:
        llm = engine(name)
        results[name] = compare(expected, log_probs(llm.model, sequence), first=prompt_len - 1)
        del llm
        _release()
    return results


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

QUALITY_COLUMNS = ["format", "mean KL (nats)", "top-1 agreement", "positions"]


def vs_bf16(row: dict, rows: list[dict]) -> str:
    """A quantized row's rate over the bf16 row of its mode and batch, as a table cell."""
    if row.get("quantization", "bf16") == "bf16":
        return "-"
    base = next((r for r in rows if r["mode"] == row["mode"] and r["batch"] == row["batch"]
                 and r.get("quantization", "bf16") == "bf16"), None)
    if base is None or not base["decode_tok_s"] or row["decode_tok_s"] is None:
        return "-"
    return f"{row['decode_tok_s'] / base['decode_tok_s']:.2f}x"


def _quality_rows(result: dict) -> list[list[str]]:
    return [[name, f"{q['mean_kl']:.4f}", f"{100 * q['top1_agreement']:.1f}%", str(q["positions"])]
            for name, q in result.get("quality", {}).items()]


def quality_markdown(result: dict) -> list[str]:
    if not result.get("quality"):
        return []
    return ["", "## Quantized logits against bf16", "",
            f"The bf16 engine's {result['config']['new_tokens']} greedy tokens after a random prompt, scored by each "
            "format's engine in one teacher-forced pass: mean KL(bf16 || format) and top-1 agreement per decoded "
            "position.", "",
            "| " + " | ".join(QUALITY_COLUMNS) + " |", "|---|" + "---:|" * (len(QUALITY_COLUMNS) - 1),
            *["| " + " | ".join(row) + " |" for row in _quality_rows(result)]]


def print_quality(console, result: dict) -> None:
    if not result.get("quality"):
        return
    from rich.table import Table

    table = Table(title="quantized logits against bf16, over the bf16 engine's greedy tokens")
    for col in QUALITY_COLUMNS:
        table.add_column(col, justify="left" if col == "format" else "right")
    for row in _quality_rows(result):
        table.add_row(*row)
    console.print(table)
