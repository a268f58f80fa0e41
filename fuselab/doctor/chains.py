"""Known chains of kernels and the fix that removes each: what a recurring sequence is, not just that it recurs.

- a per-parameter optimizer loop (AdamW with foreach=False runs mul_ -> lerp_ -> mul_ -> addcmul_ ->
  sqrt -> div -> add_ -> addcdiv_ for every parameter) -> a fused optimizer;
- an unfused norm, activation, softmax, cross-entropy or RoPE -> the fuselab kernel for it;
- attention written as matmul -> (scale, mask) -> softmax -> matmul -> scaled_dot_product_attention or
  fuselab.kernels.flash_attention, which never writes the score matrix to memory;
- anything else: graph capture for small kernels (their cost is launching), else one fused kernel.

Optimizer steps are found by the range torch.optim wraps each step in ("Optimizer.step#AdamW.step").
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from fuselab.doctor.trace import GpuEvent, RuntimeCall, Span

OPTIMIZER_STEP = "Optimizer.step#"
SMALL_KERNEL_US = 10.0  # below this a kernel's cost is mostly its launch, which a CUDA graph removes
GRAPH_FIX = "capture the step in a CUDA graph: fuselab.graphs.graphed(step_fn) (one launch for the whole sequence)"
ONE_KERNEL_FIX = "one fused kernel (torch.compile or a Triton kernel; no fuselab kernel covers this sequence)"
ATTENTION_FIX = ("torch.nn.functional.scaled_dot_product_attention(q, k, v, ...) or fuselab.kernels.flash_attention "
                 "(the score matrix never goes to memory; scale, mask and softmax run inside the kernel)")

MATMUL_LABELS = {"bmm", "matmul", "mm", "baddbmm"}
SOFTMAX_LABELS = {"_softmax", "softmax", "_safe_softmax"}
# What hand-written attention runs on the scores between its two matmuls: scale, mask, softmax, dropout, casts.
_SCORE_LABELS = SOFTMAX_LABELS | {"div", "div_", "mul", "mul_", "add", "add_", "masked_fill", "masked_fill_", "where",
                                  "copy_", "_to_copy", "clone", "native_dropout", "dropout"}
MAX_SCORE_OPS = 6


@dataclass(frozen=True)
class ChainFix:
    rule: str  # "optimizer", "kernel:rms_norm", ..., "attention", "graph", "fusion"
    action: str


def _fuselab_kernel(ops: set[str]) -> tuple[str, str] | None:
    """The fuselab kernel that replaces a chain of these ops, and what it does."""
    if {"pow", "mean", "rsqrt"} <= ops or "rms_norm" in ops or "_fused_rms_norm" in ops:
        return "rms_norm", "one kernel; a residual add before it fuses in too"
    if "silu" in ops and "mul" in ops:
        return "swiglu", "silu(gate) * up in one kernel"
    if {"native_layer_norm", "layer_norm"} & ops or {"mean", "sub", "rsqrt"} <= ops or "var_mean" in ops:
        return "layer_norm", "one kernel"
    if {"_log_softmax", "log_softmax"} & ops and {"nll_loss_forward", "nll_loss", "nll_loss_nd"} & ops:
        return "cross_entropy", "no logits-sized intermediate"
    if SOFTMAX_LABELS & ops or {"amax", "exp", "sum", "div"} <= ops:
        return "softmax", "one kernel"
    if {"neg", "cat", "mul", "add"} <= ops:
        return "apply_rope", "rotary embedding in one kernel"
    if {"tanh", "pow", "mul", "add"} <= ops or ({"erf", "mul", "add"} <= ops):
        return "bias_act", "a hand-written GELU (bias + activation) in one kernel"
    return None


def _adam_like(ops: set[str]) -> bool:
    return ("addcdiv_" in ops and bool({"addcmul_", "lerp_"} & ops)) or any(op.startswith("_foreach_addcdiv") for op in ops)


def optimizer_fix(optimizer: str | None, ops: set[str]) -> ChainFix:
    """A fused optimizer for an optimizer's update chain; `optimizer` is its class name when known."""
    name = optimizer or ("AdamW" if _adam_like(ops) else None)
    foreach = any(op.startswith("_foreach_") for op in ops)
    update = "multi-tensor (foreach) update" if foreach else "update looped over its parameters (foreach=False)"
    if name == "AdamW":
        return ChainFix("optimizer", f"a fused optimizer instead of AdamW's {update}: fuselab.optim.FusedAdamW(params, ...) "
                                     "(one launch for every parameter) or torch.optim.AdamW(..., fused=True)")
    which = f"torch.optim.{name}" if name else "the optimizer"
    return ChainFix("optimizer", f"a fused optimizer instead of {which}'s {update}: {which}(..., fused=True)"
                                 + ("" if foreach else " or foreach=True"))


def fix_for(labels: tuple[str, ...], mean_kernel_us: float, optimizer: str | None = None) -> ChainFix:
    """The fix for a recurring sequence of fusable kernels, judged from the ops in it; `optimizer` names the
    optimizer whose step launched it, if one did."""
    ops = set(labels)
    already_fused = any(op.startswith("_fused_") for op in ops)  # torch's fused optimizers: nothing left to fuse
    if (optimizer is not None or _adam_like(ops)) and not already_fused:
        return optimizer_fix(optimizer, ops)
    kernel = _fuselab_kernel(ops)
    if kernel is not None:
        name, what = kernel
        return ChainFix(f"kernel:{name}", f"fuselab.kernels.{name} ({what})")
    if mean_kernel_us < SMALL_KERNEL_US:
        return ChainFix("graph", GRAPH_FIX)
    return ChainFix("fusion", ONE_KERNEL_FIX)


def optimizer_of(events: list[GpuEvent], call_of: dict[int, RuntimeCall], annotations: list[Span]) -> list[str | None]:
    """For each GPU event, the optimizer class whose step launched it ("AdamW"), else None."""
    spans: dict[int, list[Span]] = {}
    for a in annotations:
        if a.name.startswith(OPTIMIZER_STEP):
            spans.setdefault(a.tid, []).append(a)
    if not spans:
        return [None] * len(events)
    starts = {tid: [a.ts for a in group] for tid, group in spans.items()}
    out: list[str | None] = []
    for g in events:
        call = call_of.get(g.correlation)
        name = None
        if call is not None and call.tid in spans:
            pos = bisect.bisect_right(starts[call.tid], call.ts) - 1
            if pos >= 0 and call.ts <= spans[call.tid][pos].end:
                name = spans[call.tid][pos].name.removeprefix(OPTIMIZER_STEP).split(".")[0]
        out.append(name)
    return out


@dataclass
class AttentionMatch:
    first: int  # index of the matmul that makes the scores
    between: list[int]  # the kernels on the scores (scale, mask, softmax, ...)
    second: int  # the matmul with the values


def attention_matches(members: list[list[int]], events: list[GpuEvent], labels: list[str],
                      replayed: list[bool]) -> list[AttentionMatch]:
    """Hand-written attention on each stream of each step: a matmul, up to MAX_SCORE_OPS kernels on its
    output with a softmax among them, then another matmul."""
    out = []
    for indices in members:
        by_stream: dict[tuple[int, int], list[int]] = {}
        for i in indices:
            if events[i].kind == "kernel" and not replayed[i]:
                by_stream.setdefault((events[i].device, events[i].stream), []).append(i)
        for seq in by_stream.values():
            pos = 0
            while pos < len(seq):
                if labels[seq[pos]] not in MATMUL_LABELS:
                    pos += 1
                    continue
                end = pos + 1
                while end < len(seq) and end - pos <= MAX_SCORE_OPS and labels[seq[end]] in _SCORE_LABELS:
                    end += 1
                between = seq[pos + 1:end]
                if (end < len(seq) and labels[seq[end]] in MATMUL_LABELS
                        and any(labels[i] in SOFTMAX_LABELS for i in between)):
                    out.append(AttentionMatch(seq[pos], between, seq[end]))
                    pos = end + 1
                else:
                    pos += 1
    return out
