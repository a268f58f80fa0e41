"""Rotary position embedding of queries and keys in one launch.

One program per token loads that token's cos/sin row from a precomputed cache once and rotates
every query head and every key head with it. The two layouts pair dimensions differently:
"rotate_half" (Llama, NeoX) rotates (x[i], x[i + r/2]); "interleaved" (GPT-J) rotates
(x[2i], x[2i + 1]). With a rotary dim r below the head dim, the dims past r pass through unchanged.

Out of place by default: the inputs are never written, and the outputs have the inputs' shapes and
dtypes. That keeps q and k safe to save for backward elsewhere (the projections that produce them do).
For inference, inplace=True writes the rotated q and k over the inputs (no allocations).
Backward rotates the incoming gradients by the opposite angle: the transpose of a rotation.
Positions outside [0, max_pos) of the cache give NaN rows instead of reading out of bounds.

Inputs laid out as a decode step's take `_rope_decode_kernel`, the same work with the strides that
follow from the shapes compiled in. `rope_and_store_kv` (rope_store.py) adds the KV-cache store, in
either layout. The cos/sin table comes from `rope_cos_sin` (rope_table.py); the input checks the launchers
share are in rope_checks.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from fuselab.kernels._common import indices
from fuselab.kernels._common.fast_launch import launch, prepare
from fuselab.kernels._common.launch import next_power_of_2, use_pdl
from fuselab.kernels._common.validate import check_flag, needs_autograd
from fuselab.kernels.rope_checks import _check_inputs, _decode_layout_ok, _inputs_ok, _one_token_apart, tokens_apart

# Elements of one head tile: heads are walked in blocks of this many values per pair half, which
# bounds registers for models with many heads while covering typical q heads in one step. From
# _MANY_TOKENS tokens on, q and k take smaller tiles, which leave each program fewer registers and
# more programs resident; below, the wide tile was as fast or faster (docs/tuning/rope-constants.md).
_TILE_ELEMENTS = 2048
_MANY_TOKENS = 2048
_MANY_TOKENS_TILE_ELEMENTS = 512


@triton.jit
def _rotate_heads(
    x_ptr, x_stride_h, out_ptr, out_stride_h, n_heads, cos, sin,
    cache_ptr, cache_stride_h, n_cache_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, TO_CACHE: tl.constexpr,
):
    # With TO_CACHE, the first n_cache_heads rotated heads (all of them, or none) also go to cache_ptr.
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    if INTERLEAVED:
        first, second = 2 * pairs, 2 * pairs + 1
    else:
        first, second = pairs, pairs + HALF
    for head_start in range(0, n_heads, BLOCK_HEADS):
        head = head_start + heads
        mask = (head < n_heads) & (pairs < HALF)
        x_head = x_ptr + head * x_stride_h
        out_head = out_ptr + head * out_stride_h
        x1 = tl.load(x_head + first, mask=mask).to(tl.float32)
        x2 = tl.load(x_head + second, mask=mask).to(tl.float32)
        y1 = (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty)
        y2 = (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty)
        tl.store(out_head + first, y1, mask=mask)
        tl.store(out_head + second, y2, mask=mask)
        if TO_CACHE:
            cache_head = cache_ptr + head * cache_stride_h
            cache_mask = (head < n_cache_heads) & (pairs < HALF)
            tl.store(cache_head + first, y1.to(cache_ptr.dtype.element_ty), mask=cache_mask)
            tl.store(cache_head + second, y2.to(cache_ptr.dtype.element_ty), mask=cache_mask)
        if BLOCK_PASS > 0:
            # Partial rotary: the dims past the rotary dim are copied as they are.
            dims = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
            pass_mask = (head < n_heads) & (dims < HEAD_DIM)
            passed = tl.load(x_head + dims, mask=pass_mask)
            tl.store(out_head + dims, passed, mask=pass_mask)
            if TO_CACHE:
                pass_cache_mask = (head < n_cache_heads) & (dims < HEAD_DIM)
                tl.store(cache_head + dims, passed.to(cache_ptr.dtype.element_ty), mask=pass_cache_mask)


@triton.jit
def _copy_heads(
    x_ptr, x_stride_h, out_ptr, out_stride_h, n_heads,
    BLOCK_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One token's heads, as they are, into a cache slot (n_heads = 0 copies nothing).
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    for head_start in range(0, n_heads, BLOCK_HEADS):
        head = head_start + heads
        mask = (head < n_heads) & (dims < HEAD_DIM)
        x = tl.load(x_ptr + head * x_stride_h + dims, mask=mask)
        tl.store(out_ptr + head * out_stride_h + dims, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def cos_sin_at(cos_sin_ptr, pos, max_pos, row_stride, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """(cos, sin) [1, BLOCK_HALF] fp32 of position `pos` from the table's row (cos then sin, HALF each);
    NaN for a position outside the table, so that a bad position shows in the output."""
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    in_cache = (pos >= 0) & (pos < max_pos)
    cos_sin_row = cos_sin_ptr + tl.where(in_cache, pos, 0) * row_stride
    cos = tl.load(cos_sin_row + pairs, mask=pairs < HALF).to(tl.float32)
    sin = tl.load(cos_sin_row + HALF + pairs, mask=pairs < HALF).to(tl.float32)
    return tl.where(in_cache, cos, float("nan")), tl.where(in_cache, sin, float("nan"))


@triton.jit
def token_rows(q_ptr, k_ptr, q_out_ptr, k_out_ptr, token, q_stride_t, k_stride_t, Q_WIDTH: tl.constexpr,
               K_WIDTH: tl.constexpr, IN_PLACE: tl.constexpr):
    """(q, k, q out, k out) pointers of one token of the decode layout: inputs `token · stride` in, dense
    outputs of Q_WIDTH / K_WIDTH values a token, or with IN_PLACE the inputs themselves (the output
    pointers are not read; each element is then loaded and stored by the same thread)."""
    q_src, k_src = q_ptr + token * q_stride_t, k_ptr + token * k_stride_t
    if IN_PLACE:
        q_dst, k_dst = q_src, k_src
    else:
        q_dst, k_dst = q_out_ptr + token * Q_WIDTH, k_out_ptr + token * K_WIDTH
    return q_src, k_src, q_dst, k_dst


@triton.jit
def _rope_kernel(
    q_ptr, q_stride_b, q_stride_s, q_stride_h,
    k_ptr, k_stride_b, k_stride_s, k_stride_h,
    q_out_ptr, q_out_stride_b, q_out_stride_s, q_out_stride_h,
    k_out_ptr, k_out_stride_b, k_out_stride_s, k_out_stride_h,
    positions_ptr, positions_stride_b, positions_stride_s,
    cos_sin_ptr, cos_sin_stride, max_pos,
    seq_len, n_q_heads, n_k_heads,
    # The cache store's arguments; None (dropped at compile time) unless STORE_KV.
    v_ptr, v_stride_s, v_stride_h, slot_mapping_ptr, slot_mapping_stride, num_slots,
    k_cache_ptr, k_cache_stride_block, k_cache_stride_slot, k_cache_stride_h,
    v_cache_ptr, v_cache_stride_block, v_cache_stride_slot, v_cache_stride_h,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
    STORE_KV: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_V_HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    # Tokens are numbered batch-major; a 3-D input is one batch of seq_len tokens.
    token = tl.program_id(0).to(tl.int64)
    b = token // seq_len
    s = token % seq_len
    pos = tl.load(positions_ptr + b * positions_stride_b + s * positions_stride_s).to(tl.int64)

    cos, sin = cos_sin_at(cos_sin_ptr, pos, max_pos, cos_sin_stride, HALF, BLOCK_HALF)
    if INVERSE:
        sin = -sin

    _rotate_heads(
        q_ptr + b * q_stride_b + s * q_stride_s, q_stride_h,
        q_out_ptr + b * q_out_stride_b + s * q_out_stride_s, q_out_stride_h,
        n_q_heads, cos, sin, q_out_ptr, 0, False,
        HALF, BLOCK_HALF, BLOCK_Q_HEADS, HEAD_DIM, BLOCK_PASS, INTERLEAVED, False,
    )
    if STORE_KV:
        # Inputs are [tokens, heads, head_dim] here (b == 0). Slot -1 marks a padding token: its
        # q and k are still rotated into the outputs, but nothing of it goes into the cache. Nor
        # does anything of a token whose slot is outside the cache.
        slot = tl.load(slot_mapping_ptr + s * slot_mapping_stride).to(tl.int64)
        stored = (slot >= 0) & (slot < num_slots)
        n_cache_heads = tl.where(stored, n_k_heads, 0)
        slot = tl.where(stored, slot, 0)
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        _rotate_heads(
            k_ptr + s * k_stride_s, k_stride_h, k_out_ptr + s * k_out_stride_s, k_out_stride_h,
            n_k_heads, cos, sin,
            k_cache_ptr + page * k_cache_stride_block + offset * k_cache_stride_slot, k_cache_stride_h, n_cache_heads,
            HALF, BLOCK_HALF, BLOCK_K_HEADS, HEAD_DIM, BLOCK_PASS, INTERLEAVED, True,
        )
        _copy_heads(
            v_ptr + s * v_stride_s, v_stride_h,
            v_cache_ptr + page * v_cache_stride_block + offset * v_cache_stride_slot, v_cache_stride_h,
            n_cache_heads, BLOCK_V_HEADS, HEAD_DIM, BLOCK_D,
        )
    else:
        _rotate_heads(
            k_ptr + b * k_stride_b + s * k_stride_s, k_stride_h,
            k_out_ptr + b * k_out_stride_b + s * k_out_stride_s, k_out_stride_h,
            n_k_heads, cos, sin, k_out_ptr, 0, False,
            HALF, BLOCK_HALF, BLOCK_K_HEADS, HEAD_DIM, BLOCK_PASS, INTERLEAVED, False,
        )


@triton.jit
def _rope_decode_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr, q_stride_t, k_stride_t, max_pos,
    N_Q_HEADS: tl.constexpr, N_K_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr, BLOCK_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_PDL: tl.constexpr, IN_PLACE: tl.constexpr = False,
):
    # _rope_kernel for the layout a decode step has (_decode_layout_ok): token t of q and k at t · stride,
    # heads HEAD_DIM apart, dense outputs, positions and cos/sin table. So a launch passes 9 arguments
    # instead of 39 (each costs host time in the launcher). IN_PLACE: the rotated q and k overwrite the
    # inputs (the output pointers are not read); each element is loaded and stored by the same thread.
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the kernel before may still be running: wait for its output
        tl.extra.cuda.gdc_launch_dependents()  # its inputs are ready: the next kernel may launch
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos, sin = cos_sin_at(cos_sin_ptr, pos, max_pos, 2 * HALF, HALF, BLOCK_HALF)
    q_src, k_src, q_out, k_out = token_rows(q_ptr, k_ptr, q_out_ptr, k_out_ptr, token, q_stride_t, k_stride_t,
                                            N_Q_HEADS * HEAD_DIM, N_K_HEADS * HEAD_DIM, IN_PLACE)
    _rotate_heads(
        q_src, HEAD_DIM, q_out, HEAD_DIM, N_Q_HEADS, cos, sin, q_out, 0, False,
        HALF, BLOCK_HALF, BLOCK_Q_HEADS, HEAD_DIM, BLOCK_PASS, INTERLEAVED, False,
    )
    _rotate_heads(
        k_src, HEAD_DIM, k_out, HEAD_DIM, N_K_HEADS, cos, sin, k_out, 0, False,
        HALF, BLOCK_HALF, BLOCK_K_HEADS, HEAD_DIM, BLOCK_PASS, INTERLEAVED, False,
    )

def _token_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, sequence, head) strides of a [B, S, H, D] or [T, H, D] tensor."""
    stride = t.stride()
    return stride[:3] if len(stride) == 4 else (0, stride[0], stride[1])


def _positions_strides(positions: torch.Tensor) -> tuple[int, int]:
    """(batch, sequence) strides; positions [S] for a [B, S, ...] input are shared by every batch."""
    stride = positions.stride()
    return stride if len(stride) == 2 else (0, stride[0])


def _head_block(n_heads: int, block_half: int, tile_elements: int) -> int:
    return max(1, min(next_power_of_2(max(n_heads, 1)), tile_elements // block_half))


# In the order of _rope_kernel's cache-store arguments, for a launch without the store.
_NO_STORE = (None,) * 14


@functools.cache
def _rope_meta(head_dim: int, rotary_dim: int, q_heads: int, k_heads: int, interleaved: bool, inverse: bool,
               v_heads: int | None, page_size: int | None, many_tokens: bool) -> dict:
    """The kernel's compile-time arguments, once per shape: a decode step asks for the same ones
    every layer. v_heads and page_size are None for a launch without the cache store."""
    half = rotary_dim // 2
    block_half = next_power_of_2(half)
    pass_dims = head_dim - rotary_dim
    tile = _MANY_TOKENS_TILE_ELEMENTS if many_tokens else _TILE_ELEMENTS
    meta = dict(
        HALF=half, BLOCK_HALF=block_half,
        BLOCK_Q_HEADS=_head_block(q_heads, block_half, tile), BLOCK_K_HEADS=_head_block(k_heads, block_half, tile),
        HEAD_DIM=head_dim, BLOCK_PASS=next_power_of_2(pass_dims) if pass_dims else 0,
        INTERLEAVED=interleaved, INVERSE=inverse,
        STORE_KV=False, PAGE_SIZE=None, BLOCK_V_HEADS=None, BLOCK_D=None,
    )
    if page_size is not None:
        block_d = next_power_of_2(head_dim)
        meta.update(STORE_KV=True, PAGE_SIZE=page_size, BLOCK_V_HEADS=_head_block(v_heads, block_d, _TILE_ELEMENTS),
                    BLOCK_D=block_d)
    return meta


def _launch_rope(q, k, positions, cos_sin, interleaved: bool, inverse: bool, store=None):
    """Rotate q and k into new tensors. `store` = (v, k_cache, v_cache, slot_mapping) also writes
    the rotated k and v into the caches (3-D inputs only)."""
    q_shape, k_shape, cos_sin_shape = q.shape, k.shape, cos_sin.shape
    head_dim = q_shape[-1]
    four_d = len(q_shape) == 4
    seq_len = q_shape[1] if four_d else q_shape[0]
    n_tokens = q_shape[0] * seq_len if four_d else seq_len
    # empty_like keeps a dense input's strides (a transposed [B, H, S, D] view stays one).
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if n_tokens == 0:
        return q_out, k_out
    many_tokens = n_tokens >= _MANY_TOKENS
    pdl = use_pdl(q.device)
    if store is None:
        store_args = _NO_STORE
        meta = _rope_meta(head_dim, cos_sin_shape[1], q_shape[-2], k_shape[-2], interleaved, inverse, None, None,
                          many_tokens)
    else:
        v, k_cache, v_cache, slot_mapping = store
        v_stride, cache_shape = v.stride(), k_cache.shape
        store_args = (
            v, v_stride[0], v_stride[1], slot_mapping, slot_mapping.stride()[0], cache_shape[0] * cache_shape[1],
            k_cache, *k_cache.stride()[:3], v_cache, *v_cache.stride()[:3],
        )
        meta = _rope_meta(head_dim, cos_sin_shape[1], q_shape[-2], k_shape[-2], interleaved, inverse, v.shape[1],
                          cache_shape[1], many_tokens)
    launch(_rope_kernel, (n_tokens,),
        q, *_token_strides(q),
        k, *_token_strides(k),
        q_out, *_token_strides(q_out),
        k_out, *_token_strides(k_out),
        positions, *_positions_strides(positions),
        cos_sin, cos_sin.stride()[0], cos_sin_shape[0],
        seq_len, q_shape[-2], k_shape[-2],
        *store_args, **meta, USE_PDL=pdl, launch_pdl=pdl,
    )
    return q_out, k_out


@functools.cache
def _rope_decode_launcher(head_dim: int, rotary_dim: int, q_heads: int, k_heads: int, interleaved: bool,
                          many_tokens: bool, pdl: bool, in_place: bool = False) -> Callable[..., None]:
    """_rope_decode_kernel with its compile-time arguments and launch options, once per shape."""
    meta = _rope_meta(head_dim, rotary_dim, q_heads, k_heads, interleaved, False, None, None, many_tokens)
    return prepare(_rope_decode_kernel, N_Q_HEADS=q_heads, N_K_HEADS=k_heads, HALF=meta["HALF"],
                   BLOCK_HALF=meta["BLOCK_HALF"], BLOCK_Q_HEADS=meta["BLOCK_Q_HEADS"],
                   BLOCK_K_HEADS=meta["BLOCK_K_HEADS"], HEAD_DIM=head_dim, BLOCK_PASS=meta["BLOCK_PASS"],
                   INTERLEAVED=interleaved, USE_PDL=pdl, IN_PLACE=in_place, launch_pdl=pdl)


def _launch_rope_decode(q, k, positions, cos_sin, interleaved: bool, inplace: bool = False):
    """apply_rope's launch for inputs of the decode layout (_decode_layout_ok)."""
    q_shape, k_shape, cos_sin_shape = q.shape, k.shape, cos_sin.shape
    tokens = q_shape[0] if len(q_shape) == 3 else q_shape[0] * q_shape[1]
    # empty_like is dense for inputs of this layout (a dense one keeps its strides, views of a projection
    # get contiguous ones): the kernel's addressing of the outputs.
    q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    if tokens == 0:
        return q_out, k_out
    pdl = use_pdl(q.device)
    launcher = _rope_decode_launcher(q_shape[-1], cos_sin_shape[1], q_shape[-2], k_shape[-2], interleaved,
                                     tokens >= _MANY_TOKENS, pdl, inplace)
    # In place the output pointers are not read: None costs the launcher less than a tensor.
    launcher((tokens,), q, k, None if inplace else q_out, None if inplace else k_out, positions, cos_sin,
             q.stride()[-3], k.stride()[-3], cos_sin_shape[0])
    return q_out, k_out


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, positions, cos_sin, interleaved):
        ctx.save_for_backward(positions, cos_sin)
        ctx.interleaved = interleaved
        return _launch_rope(q, k, positions, cos_sin, interleaved, inverse=False)

    @staticmethod
    def backward(ctx, grad_q_out, grad_k_out):
        positions, cos_sin = ctx.saved_tensors
        # The incoming gradients may be strided views; rotation reads any strides but a unit last one.
        grad_q_out = grad_q_out if grad_q_out.stride(-1) == 1 else grad_q_out.contiguous()
        grad_k_out = grad_k_out if grad_k_out.stride(-1) == 1 else grad_k_out.contiguous()
        grad_q, grad_k = _launch_rope(grad_q_out, grad_k_out, positions, cos_sin, ctx.interleaved, inverse=True)
        return grad_q, grad_k, None, None, None


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    layout: str = "rotate_half",
    *,
    inplace: bool = False,
    check_indices: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries q [tokens, q_heads, head_dim] and keys k [tokens, kv_heads, head_dim] (or
    [batch, seq, heads, head_dim]) by the angles of their `positions` (integers, any values, shaped
    like the leading dims, or [seq] for 4-D inputs), using a `cos_sin` cache [max_pos, rotary_dim]
    from `rope_cos_sin`. Returns new (q, k); differentiable in q and k, not in the cache.

    inplace=True rotates q and k where they lie and returns them (two allocations fewer: for
    inference, when nothing else reads the unrotated q and k). q and k must not share memory (a
    ValueError says so; views of one projection are apart), and nothing may need their gradient.

    A position outside [0, max_pos) gives its token NaN rows, and reads nothing outside the cache.
    check_indices=True (default: the FUSELAB_CHECK_INDICES environment variable) checks positions
    on the host first, a sync, and raises ValueError naming the first such position.
    """
    decode_layout = _decode_layout_ok(q, k, positions, cos_sin, layout)
    if not decode_layout and not _inputs_ok(q, k, positions, cos_sin, layout):
        _check_inputs(q, k, positions, cos_sin, layout)  # the checks one by one, which name what is wrong
    if inplace is not False:
        check_flag("inplace", inplace)
        if needs_autograd(q, k):
            raise RuntimeError("inplace=True records no gradients, but q or k requires grad: call it under "
                               "torch.no_grad() or torch.inference_mode(), or leave inplace=False")
        if not (_one_token_apart(q, k) if decode_layout and q.numel() == q.shape[-2] * q.shape[-1]
                else tokens_apart(q, k)):
            raise ValueError("inplace=True needs q and k in separate memory: rotating one in place would change "
                             "the other")
    if indices.requested(check_indices, q.device):
        indices.check_positions(positions, cos_sin.shape[0])
    interleaved = layout == "interleaved"
    if decode_layout and not needs_autograd(q, k):
        return _launch_rope_decode(q, k, positions, cos_sin, interleaved, inplace)
    if inplace:  # other layouts: out of place, then copied back
        q_out, k_out = _launch_rope(q, k, positions, cos_sin, interleaved, inverse=False)
        return q.copy_(q_out), k.copy_(k_out)
    if needs_autograd(q, k):
        return RopeFunction.apply(q, k, positions, cos_sin, interleaved)
    return _launch_rope(q, k, positions, cos_sin, interleaved, inverse=False)
