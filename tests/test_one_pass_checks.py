"""The one-pass input checks of the kernels' wrappers (`..._ok`) stand for the checks one by one: on valid
inputs they say yes (so the common case skips the one-by-one checks), and wherever they say yes the
one-by-one checks pass. Inputs: valid ones and every variant with one argument changed (another dtype,
device, rank or size, a strided view, a non-tensor)."""

from __future__ import annotations

import importlib

import pytest
import torch

from fuselab.kernels._common import validate
from fuselab.kernels.attention import paged_attention as paged

# The modules (the package's `linear` is the function).
gate_up_module = importlib.import_module("fuselab.kernels.gate_up_swiglu")
linear_module = importlib.import_module("fuselab.kernels.linear")
rope_module = importlib.import_module("fuselab.kernels.rope")
rope_store = importlib.import_module("fuselab.kernels.rope_store")


def _variants(value):
    """Values near `value` that a check may refuse: one change each."""
    out = [None, 1.0, "x"]
    if not isinstance(value, torch.Tensor):
        return out + [value, True, -1.0, float("nan")]
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.bool):
        out.append(value.to(dtype))
    out += [value.to("meta"), value.unsqueeze(0), value.reshape(-1)]
    if value.dim():
        out.append(value[0])
        out.append(value.transpose(0, -1))
    for dim, size in enumerate(value.shape):
        if size > 1:
            out.append(value.narrow(dim, 0, size - 1))
            out.append(value.narrow(dim, 0, size // 2))
            out.append(torch.cat([value, value], dim))
            out.append(value.narrow(dim, 0, 1))
        if size:
            out.append(value.index_select(dim, torch.arange(0, size, 2, device=value.device)))  # strided
            out.append(torch.cat([value, value], dim)[(slice(None),) * dim + (slice(None, None, 2),)])
    return out


def _raises(check, args) -> bool:
    try:
        check(*args)
    except (TypeError, ValueError):
        return True
    return False


def _assert_stands_for(ok, check, valid: tuple, vary: tuple | None = None):
    """`vary`: the positions changed (default all)."""
    assert ok(*valid), "the valid inputs take the one-by-one checks"
    assert not _raises(check, valid)
    accepted = 0
    for position, value in enumerate(valid):
        if vary is not None and position not in vary:
            continue
        for variant in _variants(value):
            args = (*valid[:position], variant, *valid[position + 1:])
            if ok(*args):
                accepted += 1
                assert not _raises(check, args), f"argument {position} = {variant!r} passed one check, not the other"
    assert accepted  # some variants are valid too: the predicate is not simply `False` off the valid inputs


def _check_row_vector_and_x(x, v):
    validate.check_float_tensor("x", x)
    validate.check_at_least_1d("x", x)
    validate.check_row_vector("v", v, "x", x)


def test_validate_predicates(device):
    x = torch.randn(3, 8, device=device)
    w = torch.randn(8, device=device, dtype=torch.bfloat16)
    _assert_stands_for(validate.float_tensor_ok, lambda t: validate.check_float_tensor("t", t), (x,))
    _assert_stands_for(validate.like_ok, lambda t, ref: validate.check_like("t", t, "ref", ref), (x.clone(), x),
                       vary=(0,))  # the reference is a checked tensor
    _assert_stands_for(validate.rows_and_vector_ok, _check_row_vector_and_x, (x, w))
    counters = torch.zeros(2, 3, device=device, dtype=torch.int32)
    _assert_stands_for(validate.counters_ok, validate.check_counters, (counters, 6, x.device),
                       vary=(0,))  # the count and device come from checked inputs


@pytest.mark.parametrize("bias", [False, True])
def test_linear(device, bias):
    x = torch.randn(1, 16, device=device)
    w = torch.randn(8, 16, device=device)
    b = torch.randn(8, device=device) if bias else None
    _assert_stands_for(linear_module._inputs_ok, linear_module.check_linear_inputs, (x, w, b))


def test_gate_up_swiglu(device):
    x = torch.randn(1, 16, device=device)
    weight = torch.randn(16, 8, device=device).t()  # in-major, as the engine stores it
    _assert_stands_for(gate_up_module._inputs_ok, gate_up_module._check, (x, weight))


@pytest.mark.parametrize("dims", [3, 4])
def test_rope(device, dims):
    lead = (2,) if dims == 3 else (2, 3)
    q, k = torch.randn(*lead, 4, 16, device=device), torch.randn(*lead, 2, 16, device=device)
    positions = torch.arange(lead[-1], device=device).expand(lead) if dims == 4 else torch.arange(2, device=device)
    cos_sin = torch.randn(32, 8, device=device)
    _assert_stands_for(rope_module._inputs_ok, rope_module._check_inputs, (q, k, positions, cos_sin, "rotate_half"))
    # The decode layout's predicate, which also picks the lean kernel (dense positions).
    _assert_stands_for(rope_module._decode_layout_ok, rope_module._check_inputs,
                       (q, k, positions.contiguous(), cos_sin, "rotate_half"))


def _store(device):
    k_cache = torch.zeros(4, 8, 2, 16, device=device)
    k, v = torch.randn(3, 2, 16, device=device), torch.randn(3, 2, 16, device=device)
    return k, v, k_cache, torch.zeros_like(k_cache), torch.tensor([0, 5, 9], device=device, dtype=torch.int32)


def test_caches_and_the_store(device):
    k, v, k_cache, v_cache, slots = _store(device)
    _assert_stands_for(paged._caches_ok, paged._check_caches, (k_cache, v_cache))
    _assert_stands_for(paged.store_inputs_ok, paged.check_store_inputs, (k, v, k_cache, v_cache, slots))


def test_rope_and_store_kv(device):
    k, v, k_cache, v_cache, slots = _store(device)
    q, positions = torch.randn(3, 4, 16, device=device), torch.arange(3, device=device)
    cos_sin = torch.randn(32, 16, device=device)

    def ok(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, layout):
        return (rope_module._inputs_ok(q, k, positions, cos_sin, layout) and q.dim() == 3
                and paged.store_inputs_ok(k, v, k_cache, v_cache, slot_mapping) and k_cache.dtype is k.dtype
                and v_cache.dtype is v.dtype and v.stride()[-1] == 1)

    _assert_stands_for(ok, rope_store._check_store_inputs,
                       (q, k, v, positions, cos_sin, k_cache, v_cache, slots, "rotate_half"))
    # The decode layout's predicate, which also picks the lean kernel: views of one projection too.
    _assert_stands_for(rope_store._decode_layout_ok, rope_store._check_store_inputs,
                       (q, k, v, positions, cos_sin, k_cache, v_cache, slots, "rotate_half"))
    qkv = torch.randn(3, 8, 16, device=device)
    views = (qkv[:, :4], qkv[:, 4:6], qkv[:, 6:])
    assert rope_store._decode_layout_ok(*views, positions, cos_sin, k_cache, v_cache, slots, "interleaved")


def test_decode_attention(device):
    q = torch.randn(2, 4, 16, device=device)
    k_cache = torch.zeros(6, 8, 2, 16, device=device)
    tables = torch.zeros(2, 3, device=device, dtype=torch.int32)
    lens = torch.ones(2, device=device, dtype=torch.int32)
    _assert_stands_for(paged._decode_inputs_ok, paged._check_decode_inputs,
                       (q, k_cache, torch.zeros_like(k_cache), tables, lens))
    # The dense layout's predicate, which also picks the lean kernel.
    _assert_stands_for(paged._dense_inputs_ok, paged._check_decode_inputs,
                       (q, k_cache, torch.zeros_like(k_cache), tables, lens))
