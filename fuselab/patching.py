"""Swap the modules of a Hugging Face Llama-family model for ones that call fuselab's kernels.

`patch(model)` replaces, in place:
- every RMSNorm (the decoder norms, the final norm, Qwen3's per-head q/k norms) by `FusedRMSNorm`,
  which calls `fuselab.kernels.rms_norm`;
- every gated MLP by `FusedSwiGLUMLP`, which runs `down(swiglu(gate(x), up(x)))`, fusing the
  activation and the product into one kernel;
- the rotary embedding of every attention module, through `fuselab.kernels.apply_rope` (one launch
  for q and k where Hugging Face's `apply_rotary_pos_emb` runs about sixteen small ops).

The replacements hold the original weights (the same Parameter objects, under the same names), so
an optimizer built before or after patching, and state dicts, keep working.

The attention forward of these models receives cos/sin already gathered per token and calls the
modeling module's global `apply_rotary_pos_emb`. `patch` puts a dispatcher in that global's place
(once per modeling module; the original stays as its `__wrapped__`) and wraps the forward of each
attention module of the patched model, an instance attribute, so that the dispatcher takes the
fused path only inside those forwards. Other models in the process, of the same class or not,
keep calling Hugging Face's function. The fused path rebuilds apply_rope's cache from the per-token
cos/sin (one row per token, positions 0, 1, ...); it is taken only for full rotary on float32 /
bfloat16 / float16 tensors of one dtype on the kernels' device, else the original runs.
"""

from __future__ import annotations

import functools
import inspect
import sys
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn

from fuselab.kernels import apply_rope, rms_norm, swiglu
from fuselab.kernels._common.validate import FLOAT_DTYPES, KERNEL_DEVICE_TYPE, needs_autograd

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_SILU_ACTIVATIONS = ("silu", "swish")
_ROTARY_FUNCTION = "apply_rotary_pos_emb"
_ROTARY_NOTE = "rotary embedding of {attention} left as Hugging Face's: {reason}"
# Set only while the forward of a patched model's attention module runs.
_FUSED_ROTARY_ACTIVE: ContextVar[bool] = ContextVar("fuselab_fused_rotary_active", default=False)


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
    fused_rotary: list[str] = field(default_factory=list)  # attention modules whose rotary now runs apply_rope

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


@functools.lru_cache(maxsize=32)
def _token_positions(batch: int | None, seq: int, device: torch.device) -> torch.Tensor:
    """arange(batch * seq) as [batch, seq], or arange(seq) as [seq] for batch None: every layer of a
    step asks for the same one, and an arange is a launch. Made outside inference mode so that
    autograd may save it for backward later."""
    with torch.inference_mode(False), torch.no_grad():
        if batch is None:
            return torch.arange(seq, device=device)
        return torch.arange(batch * seq, device=device).view(batch, seq)


def _fusable(q, k, cos, sin) -> bool:
    """Whether apply_rope computes what Hugging Face's function would, for these arguments: full
    rotary, one floating dtype (so the output dtype is the same), q/k [B, H, T, D] and cos/sin
    [B or 1, T, D] on the kernels' device, and no gradient wanted for cos/sin."""
    dtype = q.dtype
    if dtype not in FLOAT_DTYPES or k.dtype != dtype or cos.dtype != dtype or sin.dtype != dtype:
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    batch, _, seq, head_dim = q.shape
    if head_dim % 2 or cos.shape[-1] != head_dim or cos.shape[1] != seq or cos.shape[0] not in (1, batch):
        return False
    if k.shape[0] != batch or k.shape[2] != seq or k.shape[3] != head_dim or q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    device = q.device
    if device.type != KERNEL_DEVICE_TYPE or k.device != device or cos.device != device or sin.device != device:
        return False
    return not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))


def _fused_rotary(q, k, cos, sin, last_table: list):
    """HF's q * cos + rotate_half(q) * sin (and the same for k) through apply_rope. cos/sin hold
    each angle twice (cat(freqs, freqs)), so their first halves are one token's row of the cache,
    and token i of the flattened [B or 1, T] reads row i. last_table holds the (cos, sin, table) of
    the call before: every layer of a forward passes the same cos and sin, which the model's rotary
    embedding makes anew each forward, so the table is built once a forward, not once a layer."""
    half = q.shape[-1] // 2
    cos_batch, seq = cos.shape[:2]
    seen = last_table[0]
    if seen is not None and seen[0] is cos and seen[1] is sin:
        cos_sin = seen[2]
    else:
        cos_sin = torch.cat((cos[..., :half], sin[..., :half]), dim=-1).view(cos_batch * seq, 2 * half)
        last_table[0] = (cos, sin, cos_sin)
    # cos/sin shared by every batch (position_ids [1, T]): apply_rope takes [seq] positions for that.
    positions = _token_positions(cos_batch if cos_batch == q.shape[0] else None, seq, q.device)
    # HF's q/k are [B, T, H, D] projections seen as [B, H, T, D]: hand the kernel the former.
    # In place where no gradient is wanted: the attention forwards of SUPPORTED_MODEL_TYPES read only
    # the rotated q and k this returns, never the projections' outputs before it.
    q_out, k_out = apply_rope(q.transpose(1, 2), k.transpose(1, 2), positions, cos_sin,
                              inplace=not needs_autograd(q, k))
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


def _rotary_dispatcher(original):
    """Takes the place of a modeling module's apply_rotary_pos_emb: the fused path inside a patched
    model's attention forward when the arguments allow it, Hugging Face's function otherwise."""

    last_table: list = [None]  # see _fused_rotary

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (
            _FUSED_ROTARY_ACTIVE.get()
            and not args
            and kwargs.get("unsqueeze_dim", 1) == 1
            and kwargs.keys() <= {"unsqueeze_dim"}
            and _fusable(q, k, cos, sin)
        ):
            return _fused_rotary(q, k, cos, sin, last_table)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.fuselab_dispatcher = True
    return apply_rotary_pos_emb


class _ForwardWithFusedRotary:
    """An attention module's forward with the fused rotary path switched on around it. Set as an
    instance attribute, so the class (and every other model using it) is untouched."""

    def __init__(self, forward):
        self.forward = forward
        self.__wrapped__ = forward  # inspect.signature and friends see the original

    def __call__(self, *args, **kwargs):
        token = _FUSED_ROTARY_ACTIVE.set(True)
        try:
            return self.forward(*args, **kwargs)
        finally:
            _FUSED_ROTARY_ACTIVE.reset(token)


def _why_rotary_cannot_be_fused(attention: nn.Module) -> str | None:
    """None when the attention class applies rotary through its modeling module's global
    apply_rotary_pos_emb with HF's (q, k, cos, sin, ...) signature; else the reason."""
    modeling = sys.modules.get(type(attention).__module__)
    function = getattr(modeling, _ROTARY_FUNCTION, None)
    if not callable(function):
        return f"{type(attention).__module__} has no {_ROTARY_FUNCTION}"
    original = getattr(function, "__wrapped__", function) if getattr(function, "fuselab_dispatcher", False) else function
    # With the `kernels` package installed, transformers turns the function into a module calling it.
    signed = original.forward if isinstance(original, nn.Module) else original
    try:
        parameters = list(inspect.signature(signed).parameters)
    except (TypeError, ValueError):
        parameters = []
    if parameters[:4] != ["q", "k", "cos", "sin"]:
        return f"{_ROTARY_FUNCTION} of {type(attention).__module__} does not take (q, k, cos, sin, ...)"
    forward = inspect.unwrap(type(attention).forward)
    if _ROTARY_FUNCTION not in getattr(getattr(forward, "__code__", None), "co_names", ()):
        return f"{type(attention).__name__}.forward does not call {_ROTARY_FUNCTION}"
    return None


def _fuse_rotary(model: nn.Module, record: PatchRecord) -> None:
    reasons: dict[str, str | None] = {}  # per attention class
    for path, module in model.named_modules():
        name = type(module).__name__
        if not name.endswith("Attention"):
            continue
        if isinstance(module.__dict__.get("forward"), _ForwardWithFusedRotary):
            continue  # already patched
        if name not in reasons:
            reasons[name] = _why_rotary_cannot_be_fused(module)
            if reasons[name] is not None:
                record.left_alone.append(_ROTARY_NOTE.format(attention=name, reason=reasons[name]))
        if reasons[name] is not None:
            continue
        modeling = sys.modules[type(module).__module__]
        function = getattr(modeling, _ROTARY_FUNCTION)
        if not getattr(function, "fuselab_dispatcher", False):
            setattr(modeling, _ROTARY_FUNCTION, _rotary_dispatcher(function))
        module.forward = _ForwardWithFusedRotary(module.forward)
        record.fused_rotary.append(path)


def patch(model: nn.Module) -> PatchRecord:
    """Swap the RMSNorm and MLP modules of a Hugging Face Llama / Mistral / Qwen2 / Qwen3 model
    (any head: CausalLM, the bare model, classification) for fused ones, in place, and route its
    attention modules' rotary embedding through apply_rope; other models in the process keep
    Hugging Face's function. Patching twice changes nothing the second time. Raises ValueError for
    other architectures, whose norms or activations differ (Gemma's RMSNorm scales by 1 + weight,
    for one)."""
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
    _fuse_rotary(model, record)
    return record
