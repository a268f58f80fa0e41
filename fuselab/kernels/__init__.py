"""Fused Triton kernels, one file per op: Triton kernel(s) -> host launcher -> autograd.Function.

An op's hardware-specific path sits beside it (`cross_entropy_hopper`); `attention/` holds
FlashAttention and decode attention over a paged KV cache, with what they share; `_common/` holds what
several ops share (launch helpers, row configs, input checks). `reference` has a torch reference for
every op.
"""

from fuselab import device as _device  # noqa: F401  (selects compiled or interpreted Triton first)

from fuselab.kernels._common.launch import dependent_launches
from fuselab.kernels.add import add
from fuselab.kernels.argmax import argmax
from fuselab.kernels.attention.bound_decode import bind_decode_attention
from fuselab.kernels.attention.common import SUPPORTED_HEAD_DIMS as ATTENTION_HEAD_DIMS
from fuselab.kernels.attention.flash_attention import flash_attention, flash_attention_varlen
from fuselab.kernels.attention.paged_attention import decode_attention, store_kv
from fuselab.kernels.attention.rope_decode import bind_rope_decode_attention, rope_decode_attention
from fuselab.kernels.bias_act import bias_act
from fuselab.kernels.cross_entropy import cross_entropy
from fuselab.kernels.embedding import decode_embedding
from fuselab.kernels.gate_up_swiglu import gate_up_swiglu
from fuselab.kernels.layer_norm import layer_norm
from fuselab.kernels.linear import linear, rms_linear, rms_linear_swiglu
from fuselab.kernels.rms_norm import rms_norm
from fuselab.kernels.rope import apply_rope
from fuselab.kernels.rope_store import bind_rope_and_store_kv, rope_and_store_kv
from fuselab.kernels.rope_table import rope_cos_sin
from fuselab.kernels.softmax import softmax
from fuselab.kernels.swiglu import rms_silu_and_mul, silu_and_mul, swiglu
from fuselab.kernels.quant_pack import QUANT_FORMATS, QuantizedWeight, quantize_weight
from fuselab.kernels.quantized_linear import quantized_linear

__all__ = [
    "ATTENTION_HEAD_DIMS",
    "QUANT_FORMATS",
    "QuantizedWeight",
    "add",
    "apply_rope",
    "argmax",
    "bias_act",
    "bind_decode_attention",
    "bind_rope_and_store_kv",
    "bind_rope_decode_attention",
    "cross_entropy",
    "decode_attention",
    "decode_embedding",
    "dependent_launches",
    "flash_attention",
    "flash_attention_varlen",
    "gate_up_swiglu",
    "layer_norm",
    "linear",
    "quantize_weight",
    "quantized_linear",
    "rms_linear",
    "rms_linear_swiglu",
    "rms_norm",
    "rms_silu_and_mul",
    "rope_and_store_kv",
    "rope_decode_attention",
    "rope_cos_sin",
    "silu_and_mul",
    "softmax",
    "store_kv",
    "swiglu",
]
