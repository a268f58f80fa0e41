"""GPTQ checkpoints: 4-bit codes as AutoGPTQ, GPTQModel and transformers save them, repacked at
load into fuselab's layout (fuselab.kernels.quant_pack).

Each quantized projection `p` of in_features K and out_features N is stored as (AutoGPTQ's
QuantLinear.pack, the layout its CUDA and Triton kernels read):

- `p.qweight` int32 [K / 8, N]: code of input feature k, output n at bits 4·(k % 8) of word
  [k // 8, n] (packed along the input);
- `p.qzeros` int32 [K / group, N / 8]: zero point of group g, output n at bits 4·(n % 8) of word
  [g, n // 8] (packed along the output), stored minus one in the "gptq" format (not in "gptq_v2");
- `p.scales` float16 [K / group, N];
- `p.g_idx` int32 [K]: the group of each input feature, k // group unless desc_act reordered them;

so that W[n, k] = scales[g, n] · (code[k, n] - zero[g, n]) with g = g_idx[k]. Symmetric
checkpoints have zero point 8 everywhere, which is what fuselab's int4 codes assume.
"""

from __future__ import annotations

import torch

from fuselab.engine.config import CheckpointError, CheckpointQuantization
from fuselab.kernels.quant_pack import QuantizedWeight, pack_codes, scales_shape

GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
REQUIRED = ("qweight", "qzeros", "scales")
_INTEGER = (torch.int32,)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def split_name(name: str) -> tuple[str, str] | None:
    """(projection prefix, tensor) for a GPTQ tensor name "...q_proj.qweight"; None for any other."""
    prefix, _, part = name.rpartition(".")
    return (prefix, part) if part in GPTQ_TENSORS and prefix else None


def _unpack_nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding 8 codes each -> the codes (int32), 8x longer along `dim`, code j of a word
    from its bits 4·j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    expanded = words.unsqueeze(dim + 1) >> shifts.view([8 if d == dim + 1 else 1 for d in range(words.dim() + 1)])
    codes = expanded & 0xF
    shape = list(words.shape)
    shape[dim] *= 8
    return codes.reshape(shape)


def to_packed(tensors: dict[str, torch.Tensor], where: dict[str, str], in_features: int, out_features: int,
              quant: CheckpointQuantization, scale_dtype: torch.dtype) -> QuantizedWeight:
    """One GPTQ projection (its tensors on the target device; `where` names each one's file and
    tensor for errors) as a fuselab int4 weight [out_features, in_features]."""
    k, n, group = in_features, out_features, quant.group_size
    groups = -(-k // group)
    expected = {"qweight": (k // 8, n), "qzeros": (groups, n // 8), "scales": (groups, n), "g_idx": (k,)}
    for part, t in tensors.items():
        allowed = _FLOAT if part == "scales" else _INTEGER
        if t.dtype not in allowed:
            raise CheckpointError(f"{where[part]} has dtype {t.dtype}; GPTQ's {part} is "
                                  f"{' or '.join(str(d).removeprefix('torch.') for d in allowed)}")
        if tuple(t.shape) != expected[part] or k % 8 or n % 8:
            raise CheckpointError(f"{where[part]} has shape {tuple(t.shape)}; a GPTQ projection of {k} inputs and "
                                  f"{n} outputs in groups of {group} stores it as {expected[part]}")
    zeros = _unpack_nibbles(tensors["qzeros"], dim=1) + quant.zero_offset
    if not bool((zeros == 8).all()):
        raise CheckpointError(f"{where['qzeros']}: zero points other than 8 (an asymmetric checkpoint); only "
                              "symmetric GPTQ (sym=true) is supported")
    g_idx = tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx, torch.arange(k, device=g_idx.device, dtype=g_idx.dtype) // group):
        raise CheckpointError(f"{where['g_idx']}: input features out of group order (act-order); only desc_act=false "
                              "checkpoints are supported")
    codes = _unpack_nibbles(tensors["qweight"], dim=0).t()  # [N, K]
    scales = torch.ones(scales_shape(n, k, "int4", group), dtype=scale_dtype, device=codes.device)
    scales[:, :groups] = tensors["scales"].t()
    return QuantizedWeight(pack_codes(codes, "int4"), scales, "int4", group, k)

