"""Swap the modules of a Hugging Face Llama-family model for ones that call fuselab's kernels.

`patch(model)` replaces, in place:
- every RMSNorm (the decoder norms, the final norm, Qwen3's per-head q/k norms) by `FusedRMSNorm`,
  which calls `fuselab.kernels.rms_norm`;
- every gated MLP by `FusedSwiGLUMLP`, which runs `down(swiglu(gate(x), up(x)))`, fusing the
  activation and the product into one kernel.

The replacements hold the original weights (the same Parameter objects, under the same names), so
an optimizer built before or after patching, and state dicts, keep working.

Rotary embedding is left as it is: the attention forward of these models receives cos/sin already
gathered per token (not positions) and calls a module-level function, so `apply_rope` could only be
put in by replacing the whole attention forward or the function for every model in the process.
The record says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fuselab.kernels import rms_norm, swiglu

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_SILU_ACTIVATIONS = ("silu", "swish")
_ROTARY_NOTE = (
    "rotary embedding left as Hugging Face's: attention receives per-token cos/sin, not positions, "
    "and applies them through a module-level function"
)


class FusedRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm (and its Mistral/Qwen copies) through the fused kernel."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class FusedSwiGLUMLP(nn.Module):
    """The gated MLP down(silu(gate(x)) * up(x)), with silu and the product in one kernel."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj = gate_proj
        self.up_proj = up_proj
        self.down_proj = down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


@dataclass(frozen=True)
class Replacement:
    path: str  # the module's name in model.named_modules()
    original: str  # class name of the module that was there
    replacement: str


@dataclass
class PatchRecord:
    """What `patch` did: each module it swapped, and what it left alone and why."""

    model_type: str
    replacements: list[Replacement] = field(default_factory=list)
    left_alone: list[str] = field(default_factory=list)

    def count(self, replacement: type[nn.Module]) -> int:
        return sum(r.replacement == replacement.__name__ for r in self.replacements)


def _is_rms_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(module, "variance_epsilon")


def _is_gated_mlp(module: nn.Module) -> bool:
    return type(module).__name__.endswith("MLP") and all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _replacement_for(module: nn.Module, silu_mlp: bool) -> nn.Module | None:
    if isinstance(module, (FusedRMSNorm, FusedSwiGLUMLP)):
        return None  # already patched
    if _is_rms_norm(module):
        return FusedRMSNorm(module.weight, module.variance_epsilon)
    if silu_mlp and _is_gated_mlp(module):
        return FusedSwiGLUMLP(module.gate_proj, module.up_proj, module.down_proj)
    return None


def patch(model: nn.Module) -> PatchRecord:
    """Swap the RMSNorm and MLP modules of a Hugging Face Llama / Mistral / Qwen2 / Qwen3 model
    (any head: CausalLM, the bare model, classification) for fused ones, in place. Patching twice
    changes nothing the second time. Raises ValueError for other architectures, whose norms or
    activations differ (Gemma's RMSNorm scales by 1 + weight, for one)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model must be a Hugging Face model of type {SUPPORTED_MODEL_TYPES}, got model_type={model_type!r}")

    silu_mlp = getattr(config, "hidden_act", None) in _SILU_ACTIVATIONS
    record = PatchRecord(model_type=model_type)
    if not silu_mlp:
        record.left_alone.append(f"MLP left as it is: hidden_act={config.hidden_act!r} is not SiLU")
    record.left_alone.append(_ROTARY_NOTE)

    # Collect first: swapping children while walking named_modules() would walk the new ones.
    swaps = []
    for path, module in model.named_modules():
        replacement = _replacement_for(module, silu_mlp)
        if replacement is not None:
            swaps.append((path, module, replacement))
    for path, module, replacement in swaps:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, replacement)
        record.replacements.append(Replacement(path, type(module).__name__, type(replacement).__name__))
    return record
