"""Plain-torch references for every fused op: the tests compare against them and the eager engine runs them.

Each takes and returns tensors the way the fused op does; they favour clarity over speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# --- elementwise, norms, activations, softmax, argmax ---


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision inputs are computed in fp32, as the kernels do; fp32/fp64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


def bias_act(x: torch.Tensor, bias: torch.Tensor, activation: str = "gelu") -> torch.Tensor:
    return _ACTIVATIONS[activation](_upcast(x) + bias.to(_upcast(x).dtype)).to(x.dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's LlamaRMSNorm, with the residual add that precedes it in a decoder layer."""
    if residual is not None:
        h = x + residual
        return rms_norm(h, weight, eps), h
    xf = _upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(xf.dtype)).to(x.dtype)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm of x (+ residual), then the optional activation; with a residual also returns the sum."""
    if residual is not None:
        h = x + residual
        return layer_norm(h, weight, bias, eps, activation=activation), h
    xf = _upcast(x)
    y = F.layer_norm(xf, (x.shape[-1],), weight.to(xf.dtype), None if bias is None else bias.to(xf.dtype), eps)
    if activation is not None:
        y = _ACTIVATIONS[activation](y)
    return y.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Hugging Face's LlamaMLP activation: act_fn(gate_proj(x)) * up_proj(x)."""
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _rms_factor(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = _upcast(x)
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_linear(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, bias: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """An RMSNorm, then the projection; the norm's weight is `norm_weight`, or where None held by the projection's."""
    normed = _upcast(x) * _rms_factor(x, eps)
    if norm_weight is not None:
        normed = normed * _upcast(norm_weight)
    return F.linear(normed.to(x.dtype), weight, bias)


def rms_silu_and_mul(x: torch.Tensor, h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """silu_and_mul of x = [gate | up] scaled by 1 / rms(h), row by row."""
    return silu_and_mul(_upcast(x) * _rms_factor(h, eps)).to(x.dtype)


def silu_and_mul(x: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """vLLM's SiluAndMul: the last dim holds [gate, up]; with `pairs`, (gate, up) pairs side by side."""
    gate, up = x.unflatten(-1, (-1, 2)).unbind(-1) if pairs else x.chunk(2, dim=-1)
    return swiglu(gate, up)


def rms_linear_swiglu(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rms_linear over a weight of (gate, up) row pairs, then their SwiGLU."""
    return silu_and_mul(rms_linear(x, weight, eps), pairs=True)


def gate_up_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A Llama MLP's merged gate/up projection (weight [2I, K] = [gate | up]) and its SwiGLU."""
    return silu_and_mul(F.linear(x, weight))


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.softmax(_upcast(x), dim=dim).to(x.dtype)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Greedy decoding's pick: the index of each row's largest value (first of ties, first NaN)."""
    return torch.argmax(x, dim=-1)


def decode_embedding(weight: torch.Tensor, input_ids: torch.Tensor, last_tokens: torch.Tensor,
                     prev_rows: torch.Tensor) -> torch.Tensor:
    """weight's rows of input_ids, a negative id standing for last_tokens[prev_rows[i]]."""
    return F.embedding(torch.where(input_ids >= 0, input_ids, last_tokens[prev_rows]), weight)


# --- rope, cross-entropy, adamw ---


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The float32-upcast cross-entropy that the fused op replaces, returned in the logits' dtype."""
    loss = F.cross_entropy(
        _upcast(logits), target.long(), ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )
    return loss.to(logits.dtype)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, layout: str = "rotate_half"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding by gathering each token's cos/sin row; dims past the rotary dim pass through."""
    rotary_dim = cos_sin.shape[-1]
    half = rotary_dim // 2
    rows = cos_sin[positions.long()].unsqueeze(-2)  # broadcast over heads
    cos, sin = rows[..., :half], rows[..., half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = _upcast(x)
        rotated, passed = xf[..., :rotary_dim], xf[..., rotary_dim:]
        c, s = cos.to(xf.dtype), sin.to(xf.dtype)
        if layout == "interleaved":
            x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
            rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        else:
            x1, x2 = rotated[..., :half], rotated[..., half:]
            rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        return torch.cat((rotated, passed), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    maximize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step (Loshchilov & Hutter, decoupled decay) as torch.optim.AdamW writes it;
    `step` counts from 1. Returns the new (param, exp_avg, exp_avg_sq)."""
    beta1, beta2 = betas
    grad = -grad if maximize else grad
    param = param * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    denom = exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5 + eps
    return param - lr / (1 - beta1**step) * exp_avg / denom, exp_avg, exp_avg_sq


# --- attention ---


def _expand_kv_heads(kv: torch.Tensor, heads: int, heads_axis: int) -> torch.Tensor:
    """Repeat each key/value head for the query heads that share it (grouped-query attention)."""
    return kv.repeat_interleave(heads // kv.shape[heads_axis], dim=heads_axis)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v in q's dtype (float64 gives the exact answer); q [batch, heads, seq_q, d],
    k, v [batch, kv_heads, seq_k, d]; the causal mask is aligned top-left, as SDPA's is_causal."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf, vf = _upcast(q), _upcast(k), _upcast(v)
    kf, vf = _expand_kv_heads(kf, q.shape[1], 1), _expand_kv_heads(vf, q.shape[1], 1)
    scores = qf @ kf.transpose(-1, -2) * scale
    if causal:
        seq_q, seq_k = q.shape[-2], k.shape[-2]
        keep = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vf).to(q.dtype)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention within each packed sequence: q [tokens, heads, d], k, v [tokens, kv_heads, d];
    sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]."""
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            per_seq = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, heads, seq, d]
            out[start:end] = attention(*per_seq, causal=causal, scale=scale)[0].transpose(0, 1)
    return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write token t's k/v [tokens, kv_heads, d] into cache slot slot_mapping[t] (block · block_size +
    offset) of the [num_blocks, block_size, kv_heads, d] caches; slot -1 is padding and skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def rope_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: str = "rotate_half",
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope, then store_kv of the rotated k and of v; returns the rotated (q, k)."""
    q, k = apply_rope(q, k, positions, cos_sin, layout)
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence from a paged cache: [seq_len, kv_heads, d]."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [batch, heads, d], over its paged context of seq_lens[i]
    tokens; a sequence with no context gets zeros."""
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len > 0:
            k = gather_kv(k_cache, block_tables[i], seq_len).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, seq, d]
            v = gather_kv(v_cache, block_tables[i], seq_len).transpose(0, 1).unsqueeze(0)
            out[i] = attention(q[i][None, :, None].to(k.dtype), k, v, causal=False, scale=scale)[0, :, 0].to(q.dtype)
    return out
