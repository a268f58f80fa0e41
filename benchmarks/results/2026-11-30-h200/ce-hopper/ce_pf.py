"""Loss + gradient walking each row twice (as main), with the next chunk always in flight: each step's load
is issued before the previous chunk is folded, the gradient's walk starts from the chunk still in registers,
and its last step loads the next row's first chunk."""
import importlib
import sys

import torch
import triton
import triton.language as tl

K = 1.4426950408889634


@triton.jit
def _fold(x, lane_m, lane_s):
    new_m = tl.maximum(lane_m, tl.max(x, axis=1))
    shift = tl.where(new_m == float("-inf"), 0.0, new_m) * 1.4426950408889634
    lane_s = lane_s * tl.math.exp2(lane_m * 1.4426950408889634 - shift) + \
        tl.sum(tl.math.exp2(x * 1.4426950408889634 - shift[:, None]), axis=1)
    return new_m, lane_s


@triton.jit
def ce_pf_kernel(logits_ptr, stride, target_ptr, row_loss_ptr, grad_ptr, gstride, n_rows, n_vocab, scale,
                 CHUNK: tl.constexpr, LANE: tl.constexpr, TARGET_AFTER: tl.constexpr):
    offs = tl.arange(0, CHUNK // LANE)[:, None] * LANE + tl.arange(0, LANE)[None, :]
    n_chunks = tl.cdiv(n_vocab, CHUNK)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    first_limit = tl.where(pid < n_rows, n_vocab, 0)
    nxt = tl.load(logits_ptr + pid.to(tl.int64) * stride + offs, mask=offs < first_limit, other=float("-inf"),
                  eviction_policy="evict_last")
    log2_scale = tl.log2(scale)
    for row in range(pid, n_rows, programs):
        row = tl.cast(row, tl.int64)
        row_ptr = logits_ptr + row * stride
        grad_row = grad_ptr + row * gstride
        target = tl.load(target_ptr + row).to(tl.int64)
        lane_m = tl.full([CHUNK // LANE], float("-inf"), tl.float32)
        lane_s = tl.zeros([CHUNK // LANE], tl.float32)
        x = nxt
        for c in range(0, n_chunks):
            x = nxt
            o = (c + 1) * CHUNK + offs
            nxt = tl.load(row_ptr + o, mask=o < n_vocab, other=float("-inf"), eviction_policy="evict_last")
            lane_m, lane_s = _fold(x.to(tl.float32), lane_m, lane_s)
        m = tl.max(lane_m, axis=0)
        shift = tl.where(m == float("-inf"), 0.0, m)
        lse = shift + tl.log(tl.sum(lane_s * tl.math.exp2((lane_m - shift) * 1.4426950408889634), axis=0))
        x_t = tl.load(row_ptr + target).to(tl.float32)
        tl.store(row_loss_ptr + row, lse - x_t)
        # exp(x - lse) * scale = exp2(x * log2e - (lse * log2e - log2(scale)))
        bias = lse * 1.4426950408889634 - log2_scale
        next_limit = tl.where(row + programs < n_rows, n_vocab, 0)
        next_ptr = row_ptr + programs * stride
        for i in range(0, n_chunks):
            c = n_chunks - 1 - i
            xg = x
            o = (c - 1) * CHUNK + offs  # negative at the last step: masked off
            x = tl.load(row_ptr + o, mask=(o >= 0) & (o < n_vocab), other=float("-inf"), eviction_policy="evict_first")
            on = tl.where(c == 0, 0, n_vocab) + offs  # the next row's first chunk, at the last step only
            nxt = tl.load(next_ptr + offs, mask=on < next_limit, other=float("-inf"), eviction_policy="evict_last")
            go = c * CHUNK + offs
            g = tl.math.exp2(xg.to(tl.float32) * 1.4426950408889634 - bias)
            if not TARGET_AFTER:
                g = tl.where(go == target, g - scale, g)
            tl.store(grad_row + go, g.to(grad_ptr.dtype.element_ty), mask=go < n_vocab, cache_modifier=".cs")
        if TARGET_AFTER:
            # The target's logit: its gradient less `scale`, stored after every thread's store of the row.
            tl.debug_barrier()
            gt = tl.math.exp2(x_t * 1.4426950408889634 - bias) - scale
            tl.store(grad_row + target, gt.to(grad_ptr.dtype.element_ty))


def run(x, t, chunk, warps, per_sm, target_after=True, maxnreg=None):
    n_rows, n_vocab = x.shape
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    grad = torch.empty_like(x)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2
    kw = dict(maxnreg=maxnreg) if maxnreg else {}
    ce_pf_kernel[(min(n_rows, per_sm * sms),)](x, x.stride(0), t, row_loss, grad, grad.stride(0), n_rows, n_vocab,
                                                1.0 / n_rows, CHUNK=chunk, LANE=8, TARGET_AFTER=target_after,
                                                num_warps=warps, **kw)
    return row_loss, grad


CONFIGS = [  # chunk, warps, programs an SM, target after, maxnreg
    (16384, 32, 1, True, None),
    (32768, 32, 1, True, None),
    (16384, 32, 1, False, None),
    (32768, 16, 1, True, None),
    (16384, 16, 1, True, None),
    (16384, 16, 2, True, 64),
    (8192, 16, 2, True, 64),
    (8192, 8, 4, True, 64),
    (4096, 8, 4, True, 64),
    (8192, 16, 1, True, None),
]
