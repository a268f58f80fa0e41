"""Split-K's reduction inside the kernel that computes the splits, by the split that ends last.

SPLIT_K programs share a tile of outputs, each summing a contiguous run of K. Each stores its fp32
partial to a workspace and takes a ticket from the tile's counter (int32, zero before the launch);
the one drawing the last ticket adds the partials in split order (the same sum whichever split ends
last: deterministic) and sets the counter back to zero, so a buffer of counters can serve the next
launch on the same stream. The quantized GEMMs use it (quantized_gemm, quantized_gemm_w8a8).
"""

import torch
import triton
import triton.language as tl


def tile_counters(own: torch.Tensor | None, tiles: int, device: torch.device) -> torch.Tensor:
    """The counters a split-K launch over `tiles` tiles takes tickets from: `own` (a weight's, kept at zero by
    the kernels) when it holds enough, else a fresh zeroed buffer (inside a CUDA graph, a memset node of its
    own, which stands between the kernel before and this launch's dependent launch)."""
    if own is not None and own.numel() >= tiles:
        return own
    return torch.zeros(tiles, device=device, dtype=torch.int32)


@triton.jit
def reduce_splits(acc, WS, COUNTS, tile, ok, split, SPLIT_K: tl.constexpr):
    """(whether this split drew the last ticket of its tile, the sum of every split's `acc` when it did)
    for a 2-D tile `acc` [R, C] of fp32 sums. WS: the workspace, [tiles, SPLIT_K, R, C] fp32; COUNTS:
    one int32 counter a tile; ok: the elements kept (the others are neither written nor read)."""
    TILE: tl.constexpr = acc.shape[0] * acc.shape[1]
    parts = (WS + tile.to(tl.int64) * (SPLIT_K * TILE)
             + tl.arange(0, acc.shape[0])[:, None] * acc.shape[1] + tl.arange(0, acc.shape[1])[None, :])
    tl.store(parts + split * TILE, acc, mask=ok)
    # One thread takes the ticket (Triton issues a scalar atomic from one thread and broadcasts its
    # result): the barrier orders every thread's share of the partial before it, and the atomic's
    # release makes them visible to the split that draws the last ticket (acquire).
    tl.debug_barrier()
    ticket = tl.atomic_add(COUNTS + tile, 1, sem="acq_rel", scope="gpu")
    last = ticket == SPLIT_K - 1
    total = acc
    if last:
        total = tl.zeros(acc.shape, dtype=tl.float32)
        for i in tl.static_range(SPLIT_K):
            if i == split:
                total += acc  # this split's own partial, still in registers
            else:
                # .cg: from L2, where the other splits' stores are, never a stale line of this SM's L1.
                total += tl.load(parts + i * TILE, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(COUNTS + tile, 0)
    return last, total
