"""Attention: FlashAttention for prefill and training (forward, its Hopper forward, backward) and
decode attention over a paged KV cache, with what they share in `common`."""
