"""The Llama-family transformer over packed tokens and a paged KV cache.

Tokens of every sequence in a step are packed along one dim, [T]; `AttentionMetadata` says where
each sequence starts (prefill) or where its cached context lives (decode), and which cache slot
each token's key and value go to. Q/K/V are one projection and gate/up another, merged at load.

Two sets of ops run the same layers: "eager" calls the plain-torch references of
fuselab.kernels.reference, "fused" calls fuselab's Triton kernels: RMSNorm fused with the residual
add, SwiGLU on the merged gate/up, RoPE and the KV-cache store in one launch, varlen flash attention
for prefill, paged flash-decoding for decode, and a two-launch argmax for the greedy pick. The
projections are cuBLAS GEMMs in both, except that "fused" runs a one-row projection with few
output features (batch-1 decode's q/k/v, output and down) as a Triton GEMV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fuselab import kernels
from fuselab.engine.config import ModelConfig
from fuselab.kernels import reference


@dataclass
class AttentionMetadata:
    """Per-step inputs of attention. slot_mapping[t] = block · block_size + offset of token t's
    key and value (-1: a padding row, not stored). Prefill attends within each sequence of
    cu_seqlens; decode attends over seq_lens[i] cached tokens found through block_tables."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int32
    cu_seqlens: torch.Tensor | None = None  # prefill: [B + 1] int32
    max_seqlen: int = 0  # prefill: longest sequence, a host int so nothing waits for the device
    block_tables: torch.Tensor | None = None  # decode: [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor | None = None  # decode: [B] int32, the new token included


class Ops(NamedTuple):
    linear: Callable  # (x, weight, bias=None) -> x @ weightᵀ + bias
    rms_norm: Callable  # (x, weight, eps, residual=None) -> y, or (y, x + residual)
    silu_and_mul: Callable
    rope_and_store_kv: Callable  # (q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping) -> (q, k)
    prefill_attention: Callable  # (q, k, v, cu_seqlens, max_seqlen, scale)
    decode_attention: Callable  # (q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len)
    argmax: Callable  # [rows, vocab] -> [rows]


EAGER_OPS = Ops(
    linear=reference.linear,
    rms_norm=reference.rms_norm,
    silu_and_mul=reference.silu_and_mul,
    rope_and_store_kv=reference.rope_and_store_kv,
    prefill_attention=lambda q, k, v, cu, max_len, scale: reference.attention_varlen(q, k, v, cu, True, scale),
    decode_attention=lambda q, kc, vc, bt, sl, scale, max_len: reference.decode_attention(q, kc, vc, bt, sl, scale),
    argmax=reference.argmax,
)

FUSED_OPS = Ops(
    linear=kernels.linear,  # a Triton GEMV for one row where cuBLAS would leave SMs idle
    rms_norm=kernels.rms_norm,
    silu_and_mul=kernels.silu_and_mul,
    rope_and_store_kv=kernels.rope_and_store_kv,
    prefill_attention=lambda q, k, v, cu, max_len, scale: kernels.flash_attention_varlen(q, k, v, cu, max_len, True, scale),
    # max_seq_len is the model's limit, not this batch's: the split count then depends on shapes
    # only, which a captured decode graph needs.
    decode_attention=lambda q, kc, vc, bt, sl, scale, max_len: kernels.decode_attention(
        q, kc, vc, bt, sl, scale, max_seq_len=max_len),
    argmax=kernels.argmax,
)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps


def add_norm(ops: Ops, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the first layer has no residual yet: x is it."""
    if residual is None:
        return ops.rms_norm(x, norm.weight, norm.eps), x
    return ops.rms_norm(x, norm.weight, norm.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False, dtype=dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        self.scale = config.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor, cos_sin: torch.Tensor, max_model_len: int, ops: Ops) -> torch.Tensor:
        c = self.config
        tokens = x.shape[0]
        q, k, v = ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        # Views of the merged projection: each head's vector stays contiguous, which every op needs.
        q = q.view(tokens, c.num_heads, c.head_dim)
        k = k.view(tokens, c.num_kv_heads, c.head_dim)
        v = v.view(tokens, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        q, k = ops.rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, attn.slot_mapping)
        if attn.is_prefill:
            # Every prefill starts from an empty context (no prefix cache), so attention within the
            # new tokens is the whole of it.
            o = ops.prefill_attention(q, k, v, attn.cu_seqlens, attn.max_seqlen, self.scale)
        else:
            o = ops.decode_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, self.scale, max_model_len)
        return ops.linear(o.reshape(tokens, c.q_size), self.o_proj.weight)


def in_major_linear(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Linear:
    """A bias-free nn.Linear whose weight, [out, in] as always, is stored transposed: a row-major
    [in, out] matrix, which x · Wᵀ reads as cuBLAS's fastest layout for a few rows. For the
    projections that stay on cuBLAS at every batch size (the GEMV needs rows of W): Llama 3 8B
    at 64 rows, gate/up 61.3 -> 58.7 us, lm_head 285 -> 256 us; at one row 58.1 -> 57.3 and 253 -> 242
    (benchmarks/results/2026-11-30-h200/gemm-layout)."""
    layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    layer.weight = nn.Parameter(torch.empty(in_features, out_features, dtype=dtype).t())
    return layer


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = in_major_linear(config.hidden_size, 2 * config.intermediate_size, dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return ops.linear(ops.silu_and_mul(ops.linear(x, self.gate_up_proj.weight)), self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                attn: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor, cos_sin: torch.Tensor,
                max_model_len: int, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried beside the layer output, so that each norm adds it in the
        # same pass ((x + residual) is both normalized and kept for the next add).
        h, residual = add_norm(ops, x, residual, self.input_layernorm)
        h = self.self_attn(h, positions, attn, k_cache, v_cache, cos_sin, max_model_len, ops)
        h, residual = add_norm(ops, h, residual, self.post_attention_layernorm)
        return self.mlp(h, ops), residual


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face's, with q/k/v_proj merged into qkv_proj and
    gate/up_proj into gate_up_proj. With tied embeddings there is no lm_head: the logits
    read the embedding matrix."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_model_len: int, mode: str) -> None:
        super().__init__()
        self.config = config
        self.max_model_len = max_model_len
        self.ops = FUSED_OPS if mode in ("fused", "graphs") else EAGER_OPS
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.model.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Tied, the logits read the embedding, whose lookups need its rows: it stays row-major.
        self.lm_head = None if config.tie_word_embeddings else in_major_linear(config.hidden_size, config.vocab_size,
                                                                               dtype)
        self.cos_sin: torch.Tensor | None = None  # set by build_model on the model's device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's output, residual stream), each [T, hidden], for packed input_ids and
        positions [T]. The final norm is compute_logits', which prefill runs on its last tokens only."""
        h, residual = self.model.embed_tokens(input_ids), None
        for layer, k_cache, v_cache in zip(self.model.layers, k_caches, v_caches):
            h, residual = layer(h, residual, positions, attn, k_cache, v_cache, self.cos_sin, self.max_model_len, self.ops)
        return h, residual

    def compute_logits(self, h: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, vocab] in the model's dtype from forward's output (rows of it); into `out` when given."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        h = add_norm(self.ops, h, residual, self.model.norm)[0]
        return F.linear(h, weight) if out is None else torch.matmul(h, weight.t(), out=out)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return self.ops.argmax(logits)


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, max_model_len: int,
                mode: str) -> LlamaForCausalLM:
    """An uninitialized model on `device`: built on the meta device, so no memory is written
    twice (the weights come from a checkpoint or a random init next)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype, max_model_len, mode)
    model = model.to_empty(device=device).eval()
    model.cos_sin = kernels.rope_cos_sin(max_model_len, config.head_dim, config.rope_theta, config.rope_scaling,
                                         device=device)
    return model
