"""The rounds of `fuselab bench decode`: each mode a contender, every contender's generate timed in
turns, round after round, so that the host's speed, which moves during a run, weighs on each alike.

Decode tok/s = batch · (new − 1) / (T(new) − T(1)), T(n) the wall time of one whole generate of n
tokens a sequence; a row holds the median of its rounds and their range, and a contender measured
beside hf the median of its per-round ratios to hf's rate.
"""

from __future__ import annotations

import argparse
import statistics
import traceback
from dataclasses import dataclass
from functools import partial
from typing import Callable, TypeVar

from fuselab.bench import error_text, fmt

T = TypeVar("T")


@dataclass
class Contender:
    """One mode as the rounds see it: how it times a whole generate at a batch size, the rest of
    its row once the rounds are done, and the doctor on one of its decode steps."""

    label: str  # the mode, and its weights' format when quantized ("graphs int4")
    mode: str
    timer: Callable[[int], Callable[[int], float]]  # batch -> (new tokens -> seconds of one generate)
    extras: Callable[[int, float], dict]  # (batch, the first generate's seconds) -> the row's other columns
    diagnose: Callable[[], dict] | None = None


def decode_rate(batch: int, new_tokens: int, one_s: float, full_s: float) -> float | None:
    """Decode tok/s from two whole generates: batch · (new − 1) / (time(new tokens) − time(1 token))."""
    decode_s = full_s - one_s
    return batch * (new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else None


def attempt(label: str, failed: dict[str, str] | None, fn: Callable[[], T]) -> T | None:
    """fn(); where it raises, with `failed` given, the label is named there and None returned: one
    mode's failure (a baseline's compiler, say) costs its own rows, not the run's."""
    if failed is None:
        return fn()
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        failed[label] = error_text(err, limit=None)
        traceback.print_exc()
        print(f"{label} failed: {failed[label]}; going on with the other modes", flush=True)
        return None


def interleaved_rounds(timers: dict[str, Callable[[int], float]], batch: int, new_tokens: int, rounds: int,
                       failed: dict[str, str] | None = None) -> dict[str, list[tuple[float, float]]]:
    """Per label, (seconds of a 1-token generate, seconds of a `new_tokens` one) in each of `rounds`
    rounds. Every label takes its turn in every round, in the given order, so that a slow spell of
    the host falls on all of them. A label whose generate fails leaves the rounds (see attempt)."""
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in timers}
    for r in range(1, rounds + 1):
        for label in list(times):
            pair = attempt(label, failed, partial(_one_and_all, timers[label], new_tokens))
            if pair is None:
                del times[label]
                continue
            times[label].append(pair)
            rate = decode_rate(batch, new_tokens, *pair)
            print(f"{label} batch {batch}, round {r}/{rounds}: {fmt(rate, '.1f')} tok/s", flush=True)
    return times


def _one_and_all(generate_s: Callable[[int], float], new_tokens: int) -> tuple[float, float]:
    return generate_s(1), generate_s(new_tokens)


def _warm_up(c: Contender, batch: int, new_tokens: int) -> tuple[Callable[[int], float], float]:
    """The contender's timer at this batch size, and the seconds of its first generate."""
    generate_s = c.timer(batch)
    return generate_s, generate_s(new_tokens)


def round_stats(batch: int, new_tokens: int, times: list[tuple[float, float]]) -> dict:
    """A label's decode tok/s in each round, and their median and range."""
    rates = [decode_rate(batch, new_tokens, one, full) for one, full in times]
    got = [r for r in rates if r is not None]
    return {"decode_tok_s": statistics.median(got) if got else None, "decode_tok_s_min": min(got, default=None),
            "decode_tok_s_max": max(got, default=None), "round_tok_s": rates}


def ratio_stats(rates: list[float | None], reference: list[float | None]) -> dict:
    """Rates over the reference's (hf's) of the same rounds, one ratio a round: their median and range."""
    ratios = [a / b for a, b in zip(rates, reference) if a and b]
    if not ratios:
        return {}
    return {"vs_hf": statistics.median(ratios), "vs_hf_min": min(ratios), "vs_hf_max": max(ratios),
            "vs_hf_rounds": ratios}


def measure_contenders(contenders: list[Contender], args: argparse.Namespace, rows: list[dict], doctor: dict,
                       failed: dict[str, str] | None = None) -> None:
    """At each batch size: a warm-up generate each that reaches every context length the rounds
    will (a first pass over new lengths runs slower, in transformers eager most), --rounds rounds
    in turns, then each one's row; then the doctor on each one's decode step at the smallest batch.
    Without `failed`, a failure raises; with it, it costs the failing contender only."""
    alive = list(contenders)
    for batch in args.batch_sizes:
        timers: dict[str, Callable[[int], float]] = {}
        first_s: dict[str, float] = {}
        for c in alive:
            warm = attempt(c.label, failed, partial(_warm_up, c, batch, args.new_tokens))
            if warm is not None:
                timers[c.label], first_s[c.label] = warm
        alive = [c for c in alive if c.label in first_s]
        times = interleaved_rounds({c.label: timers[c.label] for c in alive}, batch, args.new_tokens, args.rounds,
                                   failed)
        alive = [c for c in alive if c.label in times]
        reference = round_stats(batch, args.new_tokens, times["hf"])["round_tok_s"] if "hf" in times else None
        for c in list(alive):
            row = {"mode": c.mode, "batch": batch, **round_stats(batch, args.new_tokens, times[c.label]),
                   "first_generate_s": first_s[c.label],
                   "first_generate_tok_s": decode_rate(batch, args.new_tokens,
                                                       statistics.median(one for one, _ in times[c.label]),
                                                       first_s[c.label])}
            if reference is not None and c.label != "hf":
                row.update(ratio_stats(row["round_tok_s"], reference))
            extras = attempt(c.label, failed, partial(c.extras, batch, first_s[c.label]))
            if extras is None:
                alive.remove(c)
                continue
            rows.append({**row, **extras})
            print(f"{c.label} batch {batch}: {fmt(row['decode_tok_s'], '.1f')} tok/s, median of {args.rounds} rounds "
                  f"({fmt(row['decode_tok_s_min'], '.1f')}-{fmt(row['decode_tok_s_max'], '.1f')})", flush=True)
    if args.quick:
        return
    for c in alive:
        if c.diagnose is not None:
            found = attempt(c.label, failed, c.diagnose)
            if found is not None:
                doctor[c.label] = found
