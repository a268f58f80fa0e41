"""How far a quantized model's next-token distributions are from its float model's.

The float model decodes greedily from a prompt; both models then score that same sequence in one
teacher-forced forward pass (a prefill over prompt + decoded tokens, nothing stored in the KV
cache), and at each decoded position the metrics compare their distributions: the mean
KL(float || quantized) in nats, and how often their most likely tokens agree.
"""

from __future__ import annotations

import torch

from fuselab.engine.model import AttentionMetadata, LlamaForCausalLM


@torch.inference_mode()
def log_probs(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's next-token logits after each of `token_ids`, [T, vocab] float32
    on the CPU: a prefill whose keys and values go nowhere (slot -1)."""
    device = model.model.embed_tokens.weight.device
    n = len(token_ids)
    attn = AttentionMetadata(
        is_prefill=True,
        positions=torch.arange(n, device=device),
        slot_mapping=torch.full((n,), -1, dtype=torch.int32, device=device),
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=device),
        max_seqlen=n,
    )
    h, residual = model(torch.tensor(token_ids, device=device), attn)
    return model.compute_logits(h, residual).float().log_softmax(dim=-1).cpu()


def compare(reference: torch.Tensor, other: torch.Tensor, first: int = 0) -> dict:
    """{"mean_kl", "top1_agreement", "positions"} over positions first.. of two log_probs results."""
    ref, got = reference[first:], other[first:]
    kl = (ref.exp() * (ref - got)).sum(dim=-1)
    agree = (ref.argmax(dim=-1) == got.argmax(dim=-1)).float()
    return {"mean_kl": kl.mean().item(), "top1_agreement": agree.mean().item(), "positions": ref.shape[0]}
