"""The cos/sin table that RoPE reads, built once per model: row p holds the cosines and sines of position p's
angles, with Llama 3.1's frequency scaling where a checkpoint asks for it."""

from __future__ import annotations

import math

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend between the two bands."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    original_max_pos = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = original_max_pos / low_freq_factor
    high_freq_wavelen = original_max_pos / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, blended, scaled)


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_cos_sin(
    max_pos: int,
    rotary_dim: int,
    base: float = 10000.0,
    scaling: dict | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The cache `apply_rope` reads: row p holds [cos(p * f_i) for i < r/2, sin(p * f_i) for i < r/2]
    with f_i = base^(-2i / r). `scaling` takes Llama 3.1's rope scaling, a dict with factor,
    low_freq_factor, high_freq_factor and original_max_position_embeddings (Hugging Face's
    `rope_scaling` / `rope_parameters` with rope_type "llama3"; other keys are ignored).
    Angles are computed in float64 so long contexts keep their precision.
    """
    if not isinstance(max_pos, int) or max_pos < 0:
        raise ValueError(f"max_pos must be a non-negative int, got {max_pos!r}")
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    if not base > 0:
        raise ValueError(f"base must be positive, got {base!r}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "llama3"))
        missing = [key for key in _LLAMA3_KEYS if key not in scaling]
        if rope_type != "llama3" or missing:
            raise ValueError(f"scaling must be Llama 3 rope scaling with keys {_LLAMA3_KEYS}; got {scaling!r}")
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device=device, dtype=dtype)
