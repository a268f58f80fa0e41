"""The Llama-family transformer over packed tokens and a paged KV cache.

Tokens of every sequence in a step are packed along one dim, [T]; `AttentionMetadata` says where
each sequence starts (prefill) or where its cached context lives (decode), and which cache slot
each token's key and value go to. Q/K/V are one projection and gate/up another, merged at load.
What is fixed for the model (shapes, ops, the RoPE table, each layer's KV cache) is bound at
build time, so a forward takes only the step's tensors and its metadata.

Two sets of ops run the same layers: "eager" calls the plain-torch references of
fuselab.kernels.reference, "fused" calls fuselab's Triton kernels: RMSNorm fused with the residual
add, SwiGLU on the merged gate/up, RoPE and the KV-cache store in one launch, varlen flash attention
for prefill, paged flash-decoding for decode, and a chunked argmax for the greedy pick. The
projections are cuBLAS GEMMs in both, except that "fused" runs a one-row projection with few
output features (batch-1 decode's q/k/v, output and down) as a Triton GEMV, and, in "fused" mode,
one row's gate/up projection with its SwiGLU as one Triton launch (gate_up_swiglu: fewer launches
for the host; "graphs", bound by the GPU, keeps cuBLAS there, the faster kernel). In both, the norms' weights
are folded into q/k/v and gate/up at load (fold_norms), so that a one-row decode step runs no norm kernel:
1 / rms is taken by the op after each norm, the residual adds by the output and down projections.

With a quantization scheme every projection, lm_head included, is a QuantizedLinear (packed int4,
int8 or fp8 weights, fuselab.engine.quantize): "fused" runs fuselab.kernels.quantized_linear,
"eager" its torch reference (a dequantized copy of the weight per call).

Built for one rank of N (tensor parallelism, fuselab.engine.parallel), the model is that rank's
shard: its config (parallel.shard_config) has 1/N of the heads and of the MLP width, and o_proj's
and down_proj's partial sums are all-reduced over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from fuselab import kernels
from fuselab.engine.config import ModelConfig
from fuselab.engine.parallel import TensorParallel, shard_config
from fuselab.engine.quantize import QuantizedLinear, QuantScheme, bind_quantized
from fuselab.kernels import reference, reference_quant


@dataclass
class AttentionMetadata:
    """Per-step inputs of attention. positions[t] is token t's place in its sequence (for RoPE);
    slot_mapping[t] = block · block_size + offset of its key and value (-1: a padding row, not
    stored). Prefill attends within each sequence of cu_seqlens; decode attends over seq_lens[i]
    cached tokens found through block_tables."""

    is_prefill: bool
    positions: torch.Tensor  # [T] int32 or int64
    slot_mapping: torch.Tensor  # [T] int32
    cu_seqlens: torch.Tensor | None = None  # prefill: [B + 1] int32
    max_seqlen: int = 0  # prefill: longest sequence, a host int so nothing waits for the device
    block_tables: torch.Tensor | None = None  # decode: [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor | None = None  # decode: [B] int32, the new token included


class Ops(NamedTuple):
    linear: Callable  # (x, weight, bias=None) -> x @ weightᵀ + bias
    rms_norm: Callable  # (x, weight, eps, residual=None) -> y, or (y, x + residual)
    gate_up_swiglu: Callable  # (x, gate/up weight) -> silu(x @ gateᵀ) · (x @ upᵀ)
    # The two ops over a layer's KV cache are bound to it once (bind_kv_cache), with its RoPE table, scale,
    # context limit and tickets: a layer's call then passes only the step's tensors.
    bind_rope_and_store_kv: Callable  # (cos_sin, k_cache, v_cache) -> (q, k, v, positions, slot_mapping) -> (q, k)
    prefill_attention: Callable  # (q, k, v, cu_seqlens, max_seqlen, scale)
    bind_decode_attention: Callable  # (k_cache, v_cache, scale, max_seq_len, counters) -> (q, tables, lens) -> o
    # A decode step's RoPE, cache store and attention in one launch from the qkv projection's output,
    # (cos_sin, k_cache, v_cache, scale, max_seq_len, counters) -> (qkv, tables, lens) -> o; None: the two above.
    bind_rope_decode_attention: Callable | None
    argmax: Callable  # (logits [rows, vocab], counters, out) -> [rows], into out when given
    # (embedding table, input_ids, last_tokens, prev_rows) -> a decode step's input rows: input_ids[i]'s, or where
    # that is negative (a token the host has not read yet) last_tokens[prev_rows[i]]'s, the step before's output
    decode_embedding: Callable
    # A one-row decode step with the norms folded (LlamaForCausalLM.fold_norms): the residual add in the projection
    # before, the norm (x / rms(x) · g) in the op after. A float model's g is in its weights (ones here, ignored),
    # a quantized one's is applied where x is rounded. None: the mode has no such step ("eager").
    linear_add: Callable | None = None  # (x, weight, residual) -> x @ weightᵀ + residual
    rms_linear: Callable | None = None  # (x, weight, eps, bias, g) -> norm(x) @ weightᵀ + bias
    # (h, gate/up weight, eps, g) -> silu(gate) · up of norm(h) @ weightᵀ, the weight's rows (gate, up) pairs in a
    # float model, [gate | up] in a quantized one
    rms_gate_up_swiglu: Callable | None = None
    # (h, weight, eps, g, out) -> norm(h) · g @ weightᵀ: the final norm and the logits, g apart from the weight
    # (which may be the embedding table's)
    rms_logits: Callable | None = None


def _fused_gate_up_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # One row in "fused" mode, which the host's launches bound: the projection and SwiGLU in one
    # launch (without split-K, the host's cheapest), where cuBLAS and the SwiGLU kernel take two.
    if x.shape[0] == 1:
        return kernels.gate_up_swiglu(x, weight, max_split_k=1)
    return kernels.silu_and_mul(kernels.linear(x, weight))


def _bind_reference_rope_and_store_kv(cos_sin: torch.Tensor, k_cache: torch.Tensor,
                                      v_cache: torch.Tensor) -> Callable:
    return lambda q, k, v, positions, slots: reference.rope_and_store_kv(q, k, v, positions, cos_sin, k_cache,
                                                                         v_cache, slots)


def _bind_reference_decode_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, max_seq_len: int,
                                     counters: torch.Tensor | None) -> Callable:
    # The references keep no tickets: the counters are the kernels'.
    return lambda q, tables, lens: reference.decode_attention(q, k_cache, v_cache, tables, lens, scale)


def _bind_fused_rope_and_store_kv(cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Callable:
    bound = kernels.bind_rope_and_store_kv(cos_sin, k_cache, v_cache)
    # One token (batch-1 decode, which the host's launches bound): q and k rotated where they lie, in the
    # qkv projection's output, which nothing else reads: two allocations fewer a layer.
    return lambda q, k, v, positions, slots: bound(q, k, v, positions, slots, inplace=q.shape[0] == 1)


EAGER_OPS = Ops(
    linear=reference.linear,
    rms_norm=reference.rms_norm,
    gate_up_swiglu=lambda x, w: reference.silu_and_mul(reference.linear(x, w)),
    bind_rope_and_store_kv=_bind_reference_rope_and_store_kv,
    prefill_attention=lambda q, k, v, cu, max_len, scale: reference.attention_varlen(q, k, v, cu, True, scale),
    bind_decode_attention=_bind_reference_decode_attention,
    bind_rope_decode_attention=None,
    argmax=lambda logits, counters, out: reference.argmax(logits) if out is None else out.copy_(
        reference.argmax(logits)),
    decode_embedding=reference.decode_embedding,
)

FUSED_OPS = Ops(
    linear=kernels.linear,  # a Triton GEMV for one row where cuBLAS would leave SMs idle
    rms_norm=kernels.rms_norm,
    gate_up_swiglu=_fused_gate_up_swiglu,
    bind_rope_and_store_kv=_bind_fused_rope_and_store_kv,
    prefill_attention=lambda q, k, v, cu, max_len, scale: kernels.flash_attention_varlen(
        q, k, v, cu, max_len, True, scale),
    # max_seq_len is the model's limit, not this batch's: the split count then depends on shapes
    # only, which a captured decode graph needs.
    bind_decode_attention=lambda kc, vc, scale, max_len, counters: kernels.bind_decode_attention(
        kc, vc, scale, max_len, counters=counters),
    bind_rope_decode_attention=lambda cos_sin, kc, vc, scale, max_len, counters: kernels.bind_rope_decode_attention(
        cos_sin, kc, vc, scale, max_len, counters=counters),
    argmax=lambda logits, counters, out: kernels.argmax(logits, counters=counters, out=out),
    decode_embedding=kernels.decode_embedding,  # one launch for torch's where, index, cast and lookup
    linear_add=lambda x, w, residual: kernels.linear(x, w, None, residual),  # the add in the GEMV's epilogue
    rms_linear=lambda x, w, eps, bias, g: kernels.rms_linear(x, w, eps, bias),  # x² summed in the GEMV's pass
    # Over the (gate, up) row pairs fold_norms stores: the norm, the projection and the SwiGLU in one GEMV.
    rms_gate_up_swiglu=lambda h, w, eps, g: kernels.rms_linear_swiglu(h, w, eps),
    rms_logits=lambda h, w, eps, g, out: kernels.rms_linear(h, w, eps, norm_weight=g, out=out),
)

# "graphs" replays its launches at no host cost, so the kernels faster on the GPU win there: cuBLAS and
# the SwiGLU kernel, not gate_up_swiglu (19.7 against 23.6 µs at the 1B shape on an H200).
# So too for decode attention: without tickets its merge is a second launch, sooner done on the GPU.
GRAPH_OPS = FUSED_OPS._replace(
    gate_up_swiglu=lambda x, w: kernels.silu_and_mul(kernels.linear(x, w)),
    bind_decode_attention=lambda kc, vc, scale, max_len, counters: kernels.bind_decode_attention(
        kc, vc, scale, max_len),
    bind_rope_decode_attention=lambda cos_sin, kc, vc, scale, max_len, counters: kernels.bind_rope_decode_attention(
        cos_sin, kc, vc, scale, max_len))


def paired_gate_up_ops(ops: Ops) -> Ops:
    """`ops` for a float model whose gate/up weights are (gate, up) row pairs (fold_norms): rows that are not a
    one-row step's (whose rms_gate_up_swiglu is one GEMV) run cuBLAS over the row-major weight, then the pairs'
    SwiGLU."""
    return ops._replace(gate_up_swiglu=lambda x, w: kernels.silu_and_mul(kernels.linear(x, w), pairs=True))


# Quantized models: linear is (x, weight: QuantizedWeight, bias=None, out=None).
EAGER_QUANT_OPS = EAGER_OPS._replace(
    linear=reference_quant.quantized_linear,
    gate_up_swiglu=lambda x, w: reference.silu_and_mul(reference_quant.quantized_linear(x, w)))
FUSED_QUANT_OPS = FUSED_OPS._replace(
    linear=kernels.quantized_linear,
    gate_up_swiglu=lambda x, w: kernels.silu_and_mul(kernels.quantized_linear(x, w)),
    linear_add=lambda x, w, residual: kernels.quantized_linear(x, w, residual=residual),
    rms_linear=lambda x, w, eps, bias, g: kernels.quantized_linear(x, w, bias, norm=(g, eps)),
    rms_gate_up_swiglu=lambda h, w, eps, g: kernels.silu_and_mul(kernels.quantized_linear(h, w, norm=(g, eps))),
    rms_logits=lambda h, w, eps, g, out: kernels.quantized_linear(h, w, None, out, norm=(g, eps)))
GRAPH_QUANT_OPS = FUSED_QUANT_OPS._replace(bind_decode_attention=GRAPH_OPS.bind_decode_attention,
                                           bind_rope_decode_attention=GRAPH_OPS.bind_rope_decode_attention)

# Each mode's ops, without and with a quantization scheme.
_MODE_OPS = {"eager": (EAGER_OPS, EAGER_QUANT_OPS), "fused": (FUSED_OPS, FUSED_QUANT_OPS),
             "graphs": (GRAPH_OPS, GRAPH_QUANT_OPS)}


class RMSNorm(nn.Module):
    # Plain methods rather than forward: a module call's hook handling would cost host time per
    # norm, and the eager and fused modes are bound by the host's launches.
    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps
        self.ops = ops

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_normalize(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual) in one pass; the first layer has no residual yet: x is it."""
        if residual is None:
            return self.normalize(x), x
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """Self-attention of one layer. Its shapes, ops, RoPE table and context limit are fixed at
    construction; its layer of the KV cache is bound once allocated (`bind_kv_cache`), and a CUDA
    graph captured after holds it by address."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, ops: Ops, cos_sin: torch.Tensor,
                 max_model_len: int, quant: QuantScheme | None = None, all_reduce: Callable | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = make_linear(config.hidden_size, self.q_size + 2 * self.kv_size, dtype, quant,
                                    bias=config.qkv_bias)
        self.o_proj = make_linear(self.q_size, config.hidden_size, dtype, quant)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, ops)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, ops)
        self.scale = config.head_dim**-0.5
        self.ops = ops
        self.cos_sin = cos_sin  # shared by every layer; a plain attribute, so the meta-device build keeps it
        self.max_model_len = max_model_len
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.counters: torch.Tensor | None = None  # decode attention's tickets, bound with the cache
        self.rope_and_store_kv: Callable | None = None  # the two ops over the cache, bound with it
        self.decode_attention: Callable | None = None
        self.rope_decode_attention: Callable | None = None  # the three in one, where the ops have it
        self.all_reduce = all_reduce  # tensor-parallel: sums each rank's partial o_proj output in place

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, counters: torch.Tensor) -> None:
        """This layer's cache [num_blocks, block_size, kv_heads, head_dim] and decode attention's tickets."""
        self.k_cache, self.v_cache, self.counters = k_cache, v_cache, counters
        self.rope_and_store_kv = self.ops.bind_rope_and_store_kv(self.cos_sin, k_cache, v_cache)
        self.decode_attention = self.ops.bind_decode_attention(k_cache, v_cache, self.scale, self.max_model_len,
                                                               counters)
        # q and k normalized before RoPE, or a rotary dim short of the head: the ops one by one.
        if (self.ops.bind_rope_decode_attention is not None and not self.qk_norm
                and self.cos_sin.shape[1] == self.head_dim):
            self.rope_decode_attention = self.ops.bind_rope_decode_attention(
                self.cos_sin, k_cache, v_cache, self.scale, self.max_model_len, counters)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        qkv = self.ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        out = self.ops.linear(self.attend(qkv, attn), self.o_proj.weight)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out

    def attend(self, qkv: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """Attention's output [T, q_size], before o_proj, from the qkv projection's [T, q_size + 2 · kv_size]."""
        ops, tokens = self.ops, qkv.shape[0]
        if not attn.is_prefill and self.rope_decode_attention is not None:
            o = self.rope_decode_attention(qkv, attn.block_tables, attn.seq_lens)
            return o.reshape(tokens, self.q_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Views of the merged projection: each head's vector stays contiguous, which every op needs.
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.normalize(q), self.k_norm.normalize(k)
        q, k = self.rope_and_store_kv(q, k, v, attn.positions, attn.slot_mapping)
        if attn.is_prefill:
            # Every prefill starts from an empty context (no prefix cache), so attention within the
            # new tokens is the whole of it.
            o = ops.prefill_attention(q, k, v, attn.cu_seqlens, attn.max_seqlen, self.scale)
        else:
            o = self.decode_attention(q, attn.block_tables, attn.seq_lens)
        return o.reshape(tokens, self.q_size)


def in_major_linear(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Linear:
    """A bias-free nn.Linear whose weight, [out, in] as always, is stored transposed: a row-major
    [in, out] matrix, which x · Wᵀ reads as cuBLAS's fastest layout for a few rows (Llama 3 8B's
    gate/up and lm_head run 4-10% faster at 64 rows). For the projections that stay on cuBLAS at
    every batch size: the GEMV needs rows of W."""
    layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    layer.weight = nn.Parameter(torch.empty(in_features, out_features, dtype=dtype).t())
    return layer


def make_linear(in_features: int, out_features: int, dtype: torch.dtype, quant: QuantScheme | None,
                bias: bool = False, in_major: bool = False) -> nn.Module:
    """The float projection (nn.Linear, or in_major_linear where cuBLAS reads it at every batch
    size), or with `quant` a QuantizedLinear in its place."""
    if quant is not None:
        return QuantizedLinear(in_features, out_features, quant, bias, dtype, in_major)
    if in_major:
        return in_major_linear(in_features, out_features, dtype)
    return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, ops: Ops, quant: QuantScheme | None = None,
                 all_reduce: Callable | None = None) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(config.hidden_size, 2 * config.intermediate_size, dtype, quant, in_major=True)
        self.down_proj = make_linear(config.intermediate_size, config.hidden_size, dtype, quant)
        self.ops = ops
        self.all_reduce = all_reduce  # tensor-parallel: sums each rank's partial down_proj output in place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        out = ops.linear(ops.gate_up_swiglu(x, self.gate_up_proj.weight), self.down_proj.weight)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, ops: Ops, cos_sin: torch.Tensor,
                 max_model_len: int, quant: QuantScheme | None = None, all_reduce: Callable | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype, ops, cos_sin, max_model_len, quant, all_reduce)
        self.mlp = MLP(config, dtype, ops, quant, all_reduce)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, attn: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried beside the layer output, so that each norm adds it in the
        # same pass ((x + residual) is both normalized and kept for the next add).
        h, residual = self.input_layernorm.add_and_normalize(x, residual)
        h = self.self_attn.forward(h, attn)  # forward, not __call__: see LlamaForCausalLM.forward
        h, residual = self.post_attention_layernorm.add_and_normalize(h, residual)
        return self.mlp.forward(h), residual

    def forward_folded(self, h: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """The layer for one decode row once its norms' weights are in q/k/v and gate/up (fold_norms): h is
        the whole residual stream, its adds are the output and down projections' epilogues, and each norm's
        1 / rms is taken by the op after it (the q/k/v GEMV, the SwiGLU), so no norm runs a kernel of its own.
        Returns the next residual stream."""
        ops, attention, mlp, norm1, norm2 = (self.ops, self.self_attn, self.mlp, self.input_layernorm,
                                             self.post_attention_layernorm)
        qkv = ops.rms_linear(h, attention.qkv_proj.weight, norm1.eps, attention.qkv_proj.bias, norm1.weight)
        h = ops.linear_add(attention.attend(qkv, attn), attention.o_proj.weight, h)
        x = ops.rms_gate_up_swiglu(h, mlp.gate_up_proj.weight, norm2.eps, norm2.weight)
        return ops.linear_add(x, mlp.down_proj.weight, h)


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face's, with q/k/v_proj merged into qkv_proj and
    gate/up_proj into gate_up_proj. With tied embeddings there is no lm_head: the logits
    read the embedding matrix; quantized, lm_head is a quantized copy of it (`head_copies_embedding`:
    the loader fills it), the lookups keep the float table. Build it with build_model; with
    `tensor_parallel`, config is the rank's shard (parallel.shard_config)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, ops: Ops, cos_sin: torch.Tensor,
                 max_model_len: int, quant: QuantScheme | None = None,
                 tensor_parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tensor_parallel = tensor_parallel
        all_reduce = None if tensor_parallel is None else tensor_parallel.all_reduce
        self.max_model_len = max_model_len
        self.ops = ops
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.model.layers = nn.ModuleList(DecoderLayer(config, dtype, ops, cos_sin, max_model_len, quant, all_reduce)
                                          for _ in range(config.num_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, ops)
        head_quant = quant if quant is not None and quant.quantize_head else None
        # Tied, the logits read the embedding, whose lookups need its rows: it stays row-major.
        if head_quant is None and config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = make_linear(config.hidden_size, config.vocab_size, dtype, head_quant, in_major=True)
        self.head_copies_embedding = config.tie_word_embeddings and self.lm_head is not None
        self.argmax_counters: torch.Tensor | None = None  # the greedy argmax's tickets, bound with the cache
        self.norms_folded = False  # fold_norms sets it: one-row decode steps run DecoderLayer.forward_folded

    @torch.no_grad()
    def fold_norms(self) -> None:
        """Let a one-row decode step run no norm kernel (DecoderLayer.forward_folded): 2 kernels a layer fewer.
        A float model's two norm weights g a layer go into the projections they feed (q/k/v after the input
        norm, gate/up after the post-attention one): x · diag(g) · Wᵀ = x · (W · diag(g))ᵀ, each weight rounded
        once to the model's dtype, the norms left with weights of ones. Its gate/up weights are stored as
        (gate, up) row pairs (`paired_gate_up_ops`), so that one GEMV also takes the SwiGLU: 3 kernels a layer
        fewer in all. A quantized model keeps its weights: its one-row kernels take g where they round x. For
        unsharded models, after their weights are in, in a mode that has the step (not "eager")."""
        if self.tensor_parallel is not None or self.ops.rms_linear is None:
            raise ValueError("fold_norms needs an unsharded model in a mode with the folded step (not eager)")
        for layer in self.model.layers:
            for norm, projection in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                                     (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                if isinstance(projection, nn.Linear):
                    projection.weight.mul_(norm.weight)  # over in_features, in either storage layout
                    norm.weight.fill_(1.0)
            gate_up = layer.mlp.gate_up_proj
            if isinstance(gate_up, nn.Linear):
                gate, up = gate_up.weight.chunk(2)
                gate_up.weight = nn.Parameter(torch.stack((gate, up), 1).flatten(0, 1))  # row-major [2I, K]
        if isinstance(self.model.layers[0].mlp.gate_up_proj, nn.Linear):
            ops = paired_gate_up_ops(self.ops)
            for module in self.modules():
                if hasattr(module, "ops"):
                    module.ops = ops
        self.norms_folded = True

    def bind_kv_cache(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], max_rows: int) -> None:
        """Give each layer its key and value cache, [num_blocks, block_size, kv_heads, head_dim], and the
        ticket counters of decode attention and of the greedy argmax for steps of up to max_rows sequences.

        One buffer for every layer's attention (max_rows · kv_heads) and one for the argmax (max_rows): the
        kernels run one after another on one stream, each leaving its counters at zero. Allocated here, with
        the cache, so that a CUDA graph captured after holds them by address."""
        device = k_caches[0].device
        attention_counters = torch.zeros(max_rows * k_caches[0].shape[2], dtype=torch.int32, device=device)
        for layer, k_cache, v_cache in zip(self.model.layers, k_caches, v_caches, strict=True):
            layer.self_attn.bind_kv_cache(k_cache, v_cache, attention_counters)
        self.argmax_counters = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def forward(self, input_ids: torch.Tensor, attn: AttentionMetadata,
                pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(last layer's output, residual stream), each [T, hidden], for packed input_ids [T]; a folded
        one-row decode step returns (the residual stream, None). The final norm is compute_logits', which
        prefill runs on its last tokens only. With `pending` = (last_tokens, prev_rows), a negative id is a
        token still on the device: last_tokens[prev_rows[i]]."""
        if pending is None:
            h = self.model.embed_tokens(input_ids)
        else:
            h = self.ops.decode_embedding(self.model.embed_tokens.weight, input_ids, *pending)
        residual = None
        if self.norms_folded and not attn.is_prefill and input_ids.shape[0] == 1:
            for layer in self.model.layers:
                h = layer.forward_folded(h, attn)
            return h, None
        # The layers' forward directly: a module call's hook dispatch costs host time three times a
        # layer, and the eager and fused modes are bound by the host. No hooks are registered here.
        for layer in self.model.layers:
            h, residual = layer.forward(h, residual, attn)
        return h, residual

    def compute_logits(self, h: torch.Tensor, residual: torch.Tensor | None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, vocab] in the model's dtype from forward's output (rows of it); into `out` when given.
        A folded step's (residual None) final norm goes into the logits projection's pass over h."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        norm = self.model.norm
        if residual is None and self.norms_folded:
            return self.ops.rms_logits(h, weight, norm.eps, norm.weight, out)
        h = norm.add_and_normalize(h, residual)[0]
        if isinstance(self.lm_head, QuantizedLinear):
            return self.ops.linear(h, weight, None, out)
        return F.linear(h, weight) if out is None else torch.matmul(h, weight.t(), out=out)

    def greedy(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's most likely token, int64 [rows]; into `out` when given."""
        counters = self.argmax_counters
        # A warm-up may pick for more rows than a step holds: those calls take a fresh buffer.
        if counters is not None and logits.shape[0] > counters.shape[0]:
            counters = None
        return self.ops.argmax(logits, counters, out)


def build_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, max_model_len: int,
                mode: str, quant: QuantScheme | None = None,
                tensor_parallel: TensorParallel | None = None) -> LlamaForCausalLM:
    """An uninitialized model on `device`, running `mode`'s ops (with `quant`, on quantized
    projections; with `tensor_parallel`, the rank's shard of the model of `config`): built on the
    meta device, so no memory is written twice (the weights come from a checkpoint or a random
    init next)."""
    ops = _MODE_OPS[mode][quant is not None]
    cos_sin = kernels.rope_cos_sin(max_model_len, config.head_dim, config.rope_theta, config.rope_scaling,
                                   device=device)
    if tensor_parallel is not None:
        config = shard_config(config, tensor_parallel.size)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, dtype, ops, cos_sin, max_model_len, quant, tensor_parallel)
    model = model.to_empty(device=device).eval()
    bind_quantized(model)  # the packed buffers were replaced by to_empty
    return model
