"""The Triton kernels of paged decode attention (host side: paged_attention.py).

A program of `_decode_kernel` takes one split of one sequence's context for one key/value head and the
query heads that share it; its partial output and log-sum-exp are merged by `_decode_merge_kernel`, or,
given a buffer of tickets, by the last split to finish. `_dense_decode_kernel` is the same program for
the layout of an engine's decode step (every tensor dense, the partials after the output in one
allocation): the strides follow from the shapes, so it takes 11 launch arguments where the general
kernel takes 23, each of which costs host time in the launcher.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fuselab.kernels.attention.common import tile_dot


@triton.jit
def _merge_splits(PART_OUT, PART_LSE, OUT, batch, first_head, num_heads, num_splits, stride_ob, stride_oh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr):
    # Head by head, out = Σ w_s · out_s / Σ w_s with w_s = exp2(lse_s - max lse), over the splits in a
    # fixed order, so a result does not depend on which split finished last.
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    split_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    out_row = OUT + batch.to(tl.int64) * stride_ob
    for g in range(GROUP):
        head = first_head + g
        row = (batch * num_heads + head).to(tl.int64)
        # .cg: from L2, where the other splits' stores are, never a stale line of this SM's L1.
        lse = tl.load(PART_LSE + row * num_splits + offs_s, mask=split_ok, other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # a sequence with no context: every weight is 0
        weights = tl.math.exp2(lse - m)
        parts = tl.load(PART_OUT + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=split_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
        total = tl.sum(weights, 0)
        out = tl.sum(weights[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_row + head.to(tl.int64) * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)


@triton.jit
def _decode_merge_kernel(
    PART_OUT, PART_LSE, OUT, stride_ob, stride_oh, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    # The merge as a launch of its own (no ticket buffer given): one program a (sequence, head).
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the splits may still be running: wait for their partials
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    row = tl.program_id(0)
    _merge_splits(PART_OUT, PART_LSE, OUT, row // num_heads, row % num_heads, num_heads, num_splits, stride_ob,
                  stride_oh, 1, HEAD_DIM, BLOCK_D, SPLITS_PAD)


@triton.jit
def _attend(q, table, K_head, V_head, stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot, lo, hi,
            num_blocks, qk_scale, m_i, l_i, acc, offs_d, d_ok,
            PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Online softmax over the cached tokens [lo, hi), BLOCK_N a step, across page boundaries.
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        tokens = start + offs_n
        token_ok = tokens < hi
        pages = tl.load(table + tokens // PAGE_SIZE, mask=token_ok, other=0).to(tl.int64)
        # A block id outside the cache reads as zero keys and values, never memory past the cache: a
        # compare on the ids already loaded, one a token.
        kv_ok = token_ok & (pages >= 0) & (pages < num_blocks)
        in_page = tokens % PAGE_SIZE
        kT = tl.load(K_head + (pages * stride_kc_block + in_page * stride_kc_slot)[None, :] + offs_d[:, None],
                     mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
        qk = tile_dot(q, kT, None, DOT_PRECISION) * qk_scale
        qk = tl.where(token_ok[None, :], qk, float("-inf"))
        # Each iterated block holds at least one token of the split, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_head + (pages * stride_vc_block + in_page * stride_vc_slot)[:, None] + offs_d[None, :],
                    mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        acc = tile_dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _rotated(x_ptr, offs_d, mask, cos_sin_row, HALF: tl.constexpr):
    # RoPE of head vectors along their last axis, rotate-half pairs (d, d + HALF) over the whole head:
    # x · cos + partner · ±sin in fp32, with the table row's cos then sin (HALF each), as rope.py's.
    first = offs_d < HALF
    pair = tl.where(first, offs_d, offs_d - HALF)
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    d_ok = offs_d < 2 * HALF
    cos = tl.load(cos_sin_row + pair, mask=d_ok, other=1.0).to(tl.float32)
    sin = tl.load(cos_sin_row + HALF + pair, mask=d_ok, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs_d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(x_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    return tl.where(first, x * cos - x_partner * sin, x * cos + x_partner * sin)


@triton.jit
def _decode_split(
    Q, K_CACHE, V_CACHE, BLOCK_TABLES, SEQ_LENS, PART_OUT, PART_LSE, COUNTS, OUT, COS_SIN,
    stride_qb, stride_qh, stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head, stride_table, stride_ob, stride_oh, num_splits, qk_scale,
    num_blocks, table_tokens, cos_sin_rows,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ONE_SPLIT: tl.constexpr, MERGE_HERE: tl.constexpr, USE_PDL: tl.constexpr,
    NEW_TOKEN: tl.constexpr = False, HALF: tl.constexpr = 1,
):
    # NEW_TOKEN: Q is a row of the step's qkv projection, [heads, kv heads, kv heads] head vectors: the
    # context's last token (seq_len - 1) is not in the cache yet. Its query and key are rotated (RoPE at
    # position seq_len - 1, table COS_SIN [cos_sin_rows, 2 · HALF]); the split it falls in writes its key
    # and value into the cache and attends to them from registers, the other splits read only older tokens.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    # Grid: (batch, kv_heads, splits). The split length follows this sequence's own length, read
    # here on the device, so every split of a long or short sequence gets an even share.
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    # Clamped to the tokens a table row holds, so that no length walks off it (a scalar a program).
    seq_len = tl.minimum(tl.maximum(tl.load(SEQ_LENS + batch), 0), table_tokens)
    per_split = tl.cdiv(seq_len, num_splits)
    split_len = tl.cdiv(per_split, BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    d_ok = offs_d < HEAD_DIM
    # tl.dot needs 16 rows: a group smaller than that is padded with zero queries, never stored.
    q_mask = (offs_g < GROUP)[:, None] & d_ok[None, :]
    q_ptrs = Q + batch.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    table = BLOCK_TABLES + batch.to(tl.int64) * stride_table
    K_head = K_CACHE + kv_head.to(tl.int64) * stride_kc_head
    V_head = V_CACHE + kv_head.to(tl.int64) * stride_vc_head
    if NEW_TOKEN:
        last = seq_len - 1
        # An empty sequence (last = -1) attends to nothing: its query is rotated at position 0, unused.
        in_table = last < cos_sin_rows
        cos_sin_row = COS_SIN + tl.where(in_table, tl.maximum(last, 0), 0).to(tl.int64) * (2 * HALF)
        q = _rotated(q_ptrs, offs_d[None, :], q_mask, cos_sin_row, HALF)
        q = tl.where(in_table, q, float("nan")).to(Q.dtype.element_ty)  # a position outside the table shows
        owner = (last >= lo) & (last < hi)
        hi = tl.where(owner, last, hi)  # the cache holds the tokens before the new one
    else:
        q = tl.load(q_ptrs + offs_d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    m_i, l_i, acc = _attend(q, table, K_head, V_head, stride_kc_block, stride_kc_slot, stride_vc_block,
                            stride_vc_slot, lo, hi, num_blocks, qk_scale, m_i, l_i, acc, offs_d, d_ok,
                            PAGE_SIZE, BLOCK_N, DOT_PRECISION)

    if NEW_TOKEN:
        # The new token's key and value (after the q heads in the row), stored where the block table puts
        # position seq_len - 1 (nothing stored outside the cache), and attended as one more key.
        k_row = Q + batch.to(tl.int64) * stride_qb + (num_heads + kv_head) * HEAD_DIM
        v_row = k_row + tl.num_programs(1) * HEAD_DIM
        k_new = _rotated(k_row, offs_d, d_ok, cos_sin_row, HALF).to(K_CACHE.dtype.element_ty)
        v_new = tl.load(v_row + offs_d, mask=d_ok, other=0.0)
        page = tl.load(table + tl.maximum(last, 0) // PAGE_SIZE).to(tl.int64)
        stored = owner & (page >= 0) & (page < num_blocks)
        store_ok = offs_d < tl.where(stored, HEAD_DIM, 0)
        page = tl.where(stored, page, 0)
        in_page = tl.maximum(last, 0) % PAGE_SIZE
        tl.store(K_head + page * stride_kc_block + in_page * stride_kc_slot + offs_d, k_new, mask=store_ok)
        tl.store(V_head + page * stride_vc_block + in_page * stride_vc_slot + offs_d, v_new, mask=store_ok)
        qk_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale
        m_new = tl.maximum(m_i, qk_new)
        p_new = tl.math.exp2(qk_new - m_new)
        alpha = tl.math.exp2(m_i - m_new)
        p_v = p_new.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
        l_i = tl.where(owner, l_i * alpha + p_new, l_i)
        acc = tl.where(owner, acc * alpha[:, None] + p_v, acc)
        m_i = tl.where(owner, m_new, m_i)

    # A split past the sequence's end keeps m_i = -inf, l_i = 0: its lse is -inf and the merge gives it no weight.
    head_ok = offs_g < GROUP
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if ONE_SPLIT:
        # The whole context was this program's: its output is final, and nothing is merged.
        tl.store(OUT + batch.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
    else:
        parts = ((batch * num_heads + heads) * num_splits + split).to(tl.int64)
        tl.store(PART_LSE + parts, m_i + tl.math.log2(l_safe), mask=head_ok)
        tl.store(PART_OUT + parts[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None] & d_ok[None, :])
        if MERGE_HERE:
            # One thread takes the ticket (a scalar atomic, its result broadcast): the barrier orders every
            # thread's share of the partial before it, and the atomic's release makes them visible to the
            # split that draws the last ticket (acquire). That one merges, and puts the counter back to 0.
            tl.debug_barrier()
            counter = COUNTS + batch * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                _merge_splits(PART_OUT, PART_LSE, OUT, batch, kv_head * GROUP, num_heads, num_splits, stride_ob,
                              stride_oh, GROUP, HEAD_DIM, BLOCK_D, SPLITS_PAD)
                tl.store(counter, 0)


@triton.jit
def _decode_kernel(
    Q, K_CACHE, V_CACHE, BLOCK_TABLES, SEQ_LENS, PART_OUT, PART_LSE, COUNTS, OUT,
    stride_qb, stride_qh, stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head, stride_table, stride_ob, stride_oh, num_splits, qk_scale,
    num_blocks, table_tokens,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ONE_SPLIT: tl.constexpr, MERGE_HERE: tl.constexpr, USE_PDL: tl.constexpr,
):
    _decode_split(
        Q, K_CACHE, V_CACHE, BLOCK_TABLES, SEQ_LENS, PART_OUT, PART_LSE, COUNTS, OUT, Q,
        stride_qb, stride_qh, stride_kc_block, stride_kc_slot, stride_kc_head,
        stride_vc_block, stride_vc_slot, stride_vc_head, stride_table, stride_ob, stride_oh, num_splits, qk_scale,
        num_blocks, table_tokens, 0,
        GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, DOT_PRECISION, SPLITS_PAD, ONE_SPLIT, MERGE_HERE,
        USE_PDL,
    )


@triton.jit
def _dense_decode_kernel(
    Q, K_CACHE, V_CACHE, BLOCK_TABLES, SEQ_LENS, OUT, COUNTS, COS_SIN, num_splits, qk_scale, num_blocks,
    table_tokens, cos_sin_rows,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ONE_SPLIT: tl.constexpr, MERGE_HERE: tl.constexpr, USE_PDL: tl.constexpr,
    NEW_TOKEN: tl.constexpr, HALF: tl.constexpr,
):
    # _decode_kernel for dense q and out [batch, heads, head_dim], caches [blocks, PAGE_SIZE, kv_heads,
    # head_dim] and block tables [batch, table_tokens / PAGE_SIZE]. With several splits, OUT's allocation
    # goes on past the output with the fp32 partial outputs [batch, heads, splits, head_dim], then their
    # log-sum-exps; COUNTS is None where nothing merges here. NEW_TOKEN: Q is the dense qkv projection
    # [batch, (heads + 2 · kv_heads) · head_dim], the new token's (see _decode_split); COS_SIN its table.
    kv_heads = tl.num_programs(1)
    row = kv_heads * (GROUP * HEAD_DIM)  # a sequence's heads in the output (and in q, unless NEW_TOKEN)
    q_row = kv_heads * ((GROUP + 2 * NEW_TOKEN) * HEAD_DIM)
    slot = kv_heads * HEAD_DIM  # a cache slot's heads
    n_rows = tl.num_programs(0) * (kv_heads * GROUP)
    part_out = (OUT + tl.num_programs(0) * row).to(tl.pointer_type(tl.float32), bitcast=True)
    _decode_split(
        Q, K_CACHE, V_CACHE, BLOCK_TABLES, SEQ_LENS, part_out, part_out + n_rows * num_splits * HEAD_DIM, COUNTS, OUT,
        COS_SIN, q_row, HEAD_DIM, PAGE_SIZE * slot, slot, HEAD_DIM, PAGE_SIZE * slot, slot, HEAD_DIM,
        table_tokens // PAGE_SIZE, row, HEAD_DIM, num_splits, qk_scale, num_blocks, table_tokens, cos_sin_rows,
        GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N, DOT_PRECISION, SPLITS_PAD, ONE_SPLIT, MERGE_HERE,
        USE_PDL, NEW_TOKEN, HALF,
    )
