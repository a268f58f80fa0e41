"""Sampler: next tokens from logits on the device — greedy, temperature, top-k, top-p — with no
host-side multinomial and no host sync.

Sampling uses the Gumbel-max trick: argmax(logits / T + g) with g ~ Gumbel(0, 1) per token is a
draw from softmax(logits / T). The noise is not drawn from a generator but hashed from (request
seed, output step, token id), so a request's draws depend on nothing else in its batch: the
same seed gives the same tokens alone, batched, or recomputed after preemption, and the step is
one fixed set of kernels (nothing to serialize between requests, nothing a CUDA graph cannot hold).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fuselab.engine.sequence import Sequence

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2³² for x in [0, 2³²) held in int64, in 16-bit halves of c so nothing overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (Wellons' lowbias32) on int64 tensors in [0, 2³²)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, N] in float32 for token_ids [B, N] of rows with seeds [B] and steps [B] (int64)."""
    row_key = hash32((seeds & _MASK32) ^ hash32((seeds >> 32) ^ hash32(steps & _MASK32)))
    bits = hash32(hash32(token_ids) ^ row_key[:, None])
    # 23 bits, centred in their bin: u in (0, 1) exactly representable, so -log(-log(u)) is finite.
    u = ((bits >> 9).float() + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def top_k_top_p_mask(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens of logits sorted in descending order stay candidates: the first top_k (0 = all),
    then of those the smallest prefix whose probability reaches top_p. The first always stays."""
    vocab = sorted_logits.shape[-1]
    ranks = torch.arange(vocab, device=sorted_logits.device)
    k = torch.where(top_k > 0, top_k, vocab)
    keep = ranks[None, :] < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    # A token stays while the mass ranked above it is still short of top_p.
    return keep & (probs.cumsum(dim=-1) - probs < top_p[:, None])


@dataclass
class SamplingBatch:
    """Per-row sampling parameters on the device, and, known on the host, `any_filter`: a sampled
    row with top-k or top-p, which asks for the vocabulary sorted. (An all-greedy batch never
    gets here: the runner takes the model's argmax for it.)"""

    temperature: torch.Tensor  # [B] float32; 1 on greedy rows, which take the argmax instead
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: the index of the token being drawn in the request's output
    any_filter: bool

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], device: torch.device) -> "SamplingBatch":
        params = [s.params for s in seqs]
        # Pinned, so that the copies to the GPU queue behind its work instead of waiting for it.
        pin = device.type == "cuda"
        host = dict(
            temperature=torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32, pin_memory=pin),
            greedy=torch.tensor([p.greedy for p in params], dtype=torch.bool, pin_memory=pin),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, pin_memory=pin),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, pin_memory=pin),
            seeds=torch.tensor([s.seed for s in seqs], dtype=torch.int64, pin_memory=pin),
            steps=torch.tensor([s.num_tokens - s.num_prompt_tokens for s in seqs], dtype=torch.int64, pin_memory=pin),
        )
        on_device = {k: v.to(device, non_blocking=True) for k, v in host.items()}
        return cls(**on_device, any_filter=any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params))


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Token ids [B] (int64, on the device) for logits [B, vocab] (sampled from in float32)."""
        greedy_tokens = logits.argmax(dim=-1)
        scaled = logits.float() / batch.temperature[:, None]
        if not batch.any_filter:
            # Every token a candidate: no sort. The noise is keyed by token id, so a row draws what
            # the sorted path below would draw for it.
            token_ids = torch.arange(logits.shape[-1], device=logits.device).expand(logits.shape)
            sampled = (scaled + gumbel_noise(batch.seeds, batch.steps, token_ids)).argmax(dim=-1)
            return torch.where(batch.greedy, greedy_tokens, sampled)
        # Stable, so that tied logits keep one order and a seed one outcome.
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
        keep = top_k_top_p_mask(sorted_logits, batch.top_k, batch.top_p)
        scores = sorted_logits.masked_fill(~keep, float("-inf")) + gumbel_noise(batch.seeds, batch.steps, sorted_ids)
        sampled = sorted_ids.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
        return torch.where(batch.greedy, greedy_tokens, sampled)
