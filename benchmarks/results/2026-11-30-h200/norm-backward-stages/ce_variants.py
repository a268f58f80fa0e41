"""Experimental: cross-entropy loss + gradient with persistent programs (rows stay in L2 between the walks)."""
import triton
import triton.language as tl


@triton.jit
def ce_persistent(logits_ptr, target_ptr, row_loss_ptr, grad_ptr, n_rows, n_vocab, scale,
                  CHUNK: tl.constexpr, STAGES: tl.constexpr):
    cols = tl.arange(0, CHUNK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)
        logits_row = logits_ptr + row64 * n_vocab
        grad_row = grad_ptr + row64 * n_vocab
        target = tl.load(target_ptr + row64).to(tl.int64)
        m = float("-inf")
        s = 0.0
        for start in tl.range(0, n_vocab, CHUNK, num_stages=STAGES):
            offs = start + cols
            x = tl.load(logits_row + offs, mask=offs < n_vocab, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
            m = new_m
        lse = m + tl.log(s)
        tl.store(row_loss_ptr + row64, lse - tl.load(logits_row + target).to(tl.float32))
        for start in tl.range(0, n_vocab, CHUNK, num_stages=STAGES):
            offs = start + cols
            in_vocab = offs < n_vocab
            x = tl.load(logits_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(offs == target, g - 1.0, g) * scale
            tl.store(grad_row + offs, g.to(grad_ptr.dtype.element_ty), mask=in_vocab)
