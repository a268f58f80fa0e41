"""FlashAttention for prefill and training: softmax(q·kᵀ·scale)·v without the S×S matrix in memory.

The public ops check their inputs and run `flash_forward` (Triton, or on Hopper the Gluon kernel it
hands suitable calls to), through an autograd.Function whose backward is `flash_backward`.
`flash_attention` takes padded [batch, heads, seq, head_dim] tensors, `flash_attention_varlen`
sequences packed along one [tokens, heads, head_dim] dim.
"""

from __future__ import annotations

import torch

from fuselab.kernels._common import indices
from fuselab.kernels._common.validate import check_flag, check_float_tensor, needs_autograd
from fuselab.kernels.attention.common import SUPPORTED_HEAD_DIMS, resolve_scale
from fuselab.kernels.attention.flash_backward import flash_backward
from fuselab.kernels.attention.flash_forward import flash_forward

# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, causal, scale):
        out, lse = flash_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.causal, ctx.scale = max_seqlen, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = flash_backward(dout, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None, None


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def _unit_stride_last(t: torch.Tensor) -> torch.Tensor:
    # The kernels take any batch/head/row strides (a [b, s, h, d] tensor viewed as [b, h, s, d]
    # is read in place) but need each head's vector contiguous.
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_qkv(q: object, k: object, v: object, ndim: int, layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float_tensor(name, t)
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has dtype {q.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)} but k has shape {tuple(k.shape)}")
    head_dim = q.shape[-1]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q has head dim {head_dim}; supported head dims are {SUPPORTED_HEAD_DIMS}")
    if k.shape[-1] != head_dim:
        raise ValueError(f"k has head dim {k.shape[-1]} but q has head dim {head_dim}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q's {heads} heads must be a whole multiple of k's {kv_heads} heads (grouped-query attention)")
    if q.shape[0] != k.shape[0]:
        dim = "tokens" if ndim == 3 else "batch"
        raise ValueError(f"k has {k.shape[0]} {dim} but q has {q.shape[0]}")


def _run(q, k, v, cu_seqlens, max_seqlen, causal, scale) -> torch.Tensor:
    q, k, v = _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v)
    if needs_autograd(q, k, v):
        return FlashAttentionFunction.apply(q, k, v, cu_seqlens, max_seqlen, causal, scale)
    return flash_forward(q, k, v, cu_seqlens, max_seqlen, causal, scale)[0]


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: float | None = None
) -> torch.Tensor:
    """softmax(q·kᵀ·scale [+ causal mask])·v for q [batch, heads, seq_q, head_dim] and k, v
    [batch, kv_heads, seq_k, head_dim], the layout of `F.scaled_dot_product_attention`.

    kv_heads may divide heads (grouped-query attention). The causal mask is aligned top-left, as
    SDPA's `is_causal`, and needs seq_q == seq_k. scale defaults to 1/sqrt(head_dim). Differentiable.
    """
    _check_qkv(q, k, v, 4, "[batch, heads, seq, head_dim]")
    check_flag("causal", causal)
    seq_q, seq_k = q.shape[2], k.shape[2]
    if causal and seq_q != seq_k:
        raise ValueError(f"causal attention needs as many keys as queries: k has seq {seq_k}, q has seq {seq_q}")
    if seq_k == 0 and seq_q > 0:
        raise ValueError("k has no keys: attention over an empty sequence is undefined")
    scale = resolve_scale(scale, q.shape[-1])
    if q.numel() == 0:
        return torch.empty_like(q)
    return _run(q, k, v, None, seq_q, causal, scale)


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool = True,
    scale: float | None = None,
    *,
    check_indices: bool | None = None,
) -> torch.Tensor:
    """Attention within each of several sequences packed along the first dim: q [tokens, heads,
    head_dim], k, v [tokens, kv_heads, head_dim].

    Sequence i holds rows cu_seqlens[i] to cu_seqlens[i+1] (int32, starting at 0, on q's device);
    max_seqlen must be at least the longest sequence. It is a host int so that nothing here waits
    for the device. Rows past cu_seqlens[-1] are not written. Differentiable.

    Offsets outside [0, tokens] are clamped to it on the device, so no cu_seqlens makes the kernels
    touch memory outside q, k, v and the output; the result is then undefined. check_indices=True
    (default: the FUSELAB_CHECK_INDICES environment variable) checks cu_seqlens and max_seqlen on
    the host first, a sync, and raises ValueError naming the bad entry.
    """
    _check_qkv(q, k, v, 3, "[tokens, heads, head_dim]")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with batch + 1 offsets, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
    check_flag("causal", causal)
    scale = resolve_scale(scale, q.shape[-1])
    if indices.requested(check_indices, q.device):
        indices.check_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen)
    # No sequence is longer than the tokens there are: a larger max_seqlen would only add idle programs.
    max_seqlen = min(max_seqlen, q.shape[0])
    if q.numel() == 0 or max_seqlen == 0 or cu_seqlens.numel() == 1:
        return torch.zeros_like(q)
    return _run(q, k, v, cu_seqlens.contiguous(), max_seqlen, causal, scale)
