"""Every public kernel on every float dtype it takes, forward and (where differentiable) backward,
against float64 references: no dtype path may return garbage.

Shapes are small and awkward (odd widths, partial blocks, grouped-query heads, padding slots) so
that the sweep stays fast in the interpreter while still crossing block edges. The op-specific
test files go deeper into each op; this one is the cross-product of ops and dtypes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPES, assert_close, leaf, lower_block_cap

import fuselab.kernels as kernels
from fuselab.kernels import reference

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")

over_dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
# Row ops also stream rows longer than their block cap in blocks: lowered, 37 columns take that path.
over_row_paths = pytest.mark.parametrize("looped", [False, True], ids=["one-block", "looped"])


def _randn(shape, dtype, device, seed, scale=1.0):
    return (scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype).to(device)


def _check_grads(fn, ref_fn, inputs, dout, dtype, scale=1.0):
    """fn's gradients against float64 autograd of ref_fn, both from the same (rounded) inputs."""
    ours = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*ours)
    out.backward(dout)
    theirs = [leaf(t) for t in inputs]
    ref_fn(*theirs).backward(dout.double())
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.grad is not None and a.grad.dtype == dtype, f"input {i}"
        assert_close(a.grad, b.grad, dtype, scale)


def test_the_sweep_covers_every_public_op():
    swept = {"add", "apply_rope", "argmax", "bias_act", "cross_entropy", "decode_attention", "flash_attention",
             "flash_attention_varlen", "layer_norm", "linear", "rms_norm", "rope_and_store_kv", "rope_cos_sin",
             "silu_and_mul", "softmax", "store_kv", "swiglu",
             "quantized_linear",  # swept over the activation dtypes in test_quant_kernels.py
             "gate_up_swiglu",  # swept over the dtypes in test_kernels_gate_up_swiglu.py
             "bind_decode_attention", "bind_rope_and_store_kv",  # in test_kernels_bound_*.py
             "rope_decode_attention", "bind_rope_decode_attention",  # in test_kernels_rope_decode.py
             "rms_linear", "rms_linear_swiglu", "rms_silu_and_mul",  # in test_kernels_folded_norm.py
             "decode_embedding"}  # in test_kernels_embedding.py
    not_ops = {"ATTENTION_HEAD_DIMS", "dependent_launches", "QUANT_FORMATS", "QuantizedWeight", "quantize_weight"}
    assert set(kernels.__all__) == swept | not_ops


# --------------------------------------------------------------------------------------------
# elementwise
# --------------------------------------------------------------------------------------------


@over_dtypes
def test_add(device, dtype):
    a, b = _randn((3, 37), dtype, device, 0), _randn((3, 37), dtype, device, 1)
    out = kernels.add(a, b)
    assert out.dtype == dtype
    assert_close(out, a.double() + b.double(), dtype)
    _check_grads(kernels.add, reference.add, (a, b), _randn((3, 37), dtype, device, 2), dtype)


@over_dtypes
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bias_act(device, dtype, activation):
    x, bias, dy = _randn((5, 37), dtype, device, 0), _randn((37,), dtype, device, 1), _randn((5, 37), dtype, device, 2)
    out = kernels.bias_act(x, bias, activation)
    assert out.dtype == dtype
    assert_close(out, reference.bias_act(x.double(), bias.double(), activation), dtype)
    _check_grads(lambda x, b: kernels.bias_act(x, b, activation), lambda x, b: reference.bias_act(x, b, activation),
                 (x, bias), dy, dtype, scale=4)


@over_dtypes
def test_swiglu_and_silu_and_mul(device, dtype):
    gate, up, dy = (_randn((3, 37), dtype, device, seed) for seed in range(3))
    assert_close(kernels.swiglu(gate, up), reference.swiglu(gate.double(), up.double()), dtype)
    _check_grads(kernels.swiglu, reference.swiglu, (gate, up), dy, dtype)
    x = _randn((3, 74), dtype, device, 3)
    assert_close(kernels.silu_and_mul(x), reference.silu_and_mul(x.double()), dtype)
    _check_grads(kernels.silu_and_mul, reference.silu_and_mul, (x,), dy, dtype)


# --------------------------------------------------------------------------------------------
# rows: norms, softmax, argmax, cross-entropy, linear
# --------------------------------------------------------------------------------------------


@over_dtypes
@over_row_paths
def test_rms_norm(device, monkeypatch, dtype, looped):
    if looped:
        lower_block_cap(monkeypatch, "rms_norm", 16)
    x, r, dy = (_randn((3, 37), dtype, device, seed) for seed in range(3))
    w = (1 + _randn((37,), torch.float32, device, 3, scale=0.1)).to(dtype)
    assert_close(kernels.rms_norm(x, w), reference.rms_norm(x.double(), w.double()), dtype)
    y, h = kernels.rms_norm(x, w, residual=r)
    ref_y, ref_h = reference.rms_norm(x.double(), w.double(), residual=r.double())
    assert_close(h, ref_h, dtype)
    assert_close(y, ref_y, dtype)
    _check_grads(kernels.rms_norm, reference.rms_norm, (x, w), dy, dtype, scale=4)


@over_dtypes
@over_row_paths
def test_layer_norm(device, monkeypatch, dtype, looped):
    if looped:
        lower_block_cap(monkeypatch, "layer_norm", 16)
    x, r, dy = (_randn((3, 37), dtype, device, seed) for seed in range(3))
    w = (1 + _randn((37,), torch.float32, device, 3, scale=0.1)).to(dtype)
    b = _randn((37,), dtype, device, 4, scale=0.1)
    assert_close(kernels.layer_norm(x, w, b), reference.layer_norm(x.double(), w.double(), b.double()), dtype)
    y, h = kernels.layer_norm(x, w, None, residual=r, activation="gelu")
    ref_y, ref_h = reference.layer_norm(x.double(), w.double(), None, residual=r.double(), activation="gelu")
    assert_close(h, ref_h, dtype)
    assert_close(y, ref_y, dtype)
    _check_grads(kernels.layer_norm, reference.layer_norm, (x, w, b), dy, dtype, scale=4)


@over_dtypes
@over_row_paths
def test_softmax(device, monkeypatch, dtype, looped):
    if looped:
        lower_block_cap(monkeypatch, "softmax", 16)
    x, dy = _randn((3, 37), dtype, device, 0, scale=3), _randn((3, 37), dtype, device, 1)
    assert_close(kernels.softmax(x), torch.softmax(x.double(), -1), dtype)
    _check_grads(kernels.softmax, lambda x: torch.softmax(x, -1), (x,), dy, dtype)


@over_dtypes
def test_argmax(device, dtype):
    x = _randn((3, 37), dtype, device, 0)
    x[1, [4, 20]] = 9.0  # a tie: the first wins
    assert kernels.argmax(x).tolist() == torch.argmax(x.double(), -1).tolist()


@over_dtypes
# With the interpreter's 4 SMs: 1 row is split across programs for the loss and for the gradient, 3 rows
# for the loss only, and 9 rows of a short vocabulary are walked whole, in chunks of 16 logits.
@pytest.mark.parametrize("rows, vocab", [(1, 1100), (3, 1100), (9, 77)])
def test_cross_entropy(device, monkeypatch, dtype, rows, vocab):
    if vocab < 100:
        lower_block_cap(monkeypatch, "cross_entropy", 16)
    g = torch.Generator().manual_seed(0)
    logits = _randn((rows, vocab), dtype, device, 1, scale=3)
    target = torch.randint(0, vocab, (rows,), generator=g)
    if rows > 1:
        target[1] = -100
    target = target.to(device)
    for reduction in ("mean", "none"):
        kw = dict(reduction=reduction, label_smoothing=0.1)
        loss = kernels.cross_entropy(logits, target, **kw)
        assert loss.dtype == dtype
        assert_close(loss, reference.cross_entropy(logits.double(), target, **kw), dtype)
    dloss = torch.tensor(1.5, dtype=dtype, device=device)
    _check_grads(lambda x: kernels.cross_entropy(x, target, label_smoothing=0.1),
                 lambda x: reference.cross_entropy(x, target, label_smoothing=0.1), (logits,), dloss, dtype, scale=2)


@over_dtypes
@pytest.mark.parametrize("rows", [1, 3])  # one row: the GEMV kernel; more: F.linear
def test_linear(device, dtype, rows):
    x, w, b = _randn((rows, 37), dtype, device, 0), _randn((11, 37), dtype, device, 1), _randn((11,), dtype, device, 2)
    expected = reference.linear(x.double(), w.double(), b.double())
    assert_close(kernels.linear(x, w, b), expected, dtype)


# --------------------------------------------------------------------------------------------
# rotary embedding and the paged KV cache
# --------------------------------------------------------------------------------------------


@over_dtypes
def test_rope_cos_sin(device, dtype):
    table = kernels.rope_cos_sin(40, 6, device=device, dtype=dtype)
    angles = torch.outer(torch.arange(40, dtype=torch.float64), 10000.0 ** (-torch.arange(0, 6, 2) / 6).double())
    assert table.dtype == dtype
    assert_close(table, torch.cat([angles.cos(), angles.sin()], -1), dtype)


@over_dtypes
@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
def test_apply_rope(device, dtype, layout):
    q, k = _randn((5, 3, 20), dtype, device, 0), _randn((5, 1, 20), dtype, device, 1)
    positions = torch.tensor([0, 7, 3, 39, 12], device=device)
    cos_sin = kernels.rope_cos_sin(40, 12, device=device, dtype=dtype)  # rotary dim < head dim
    got_q, got_k = kernels.apply_rope(q, k, positions, cos_sin, layout)
    ref_q, ref_k = reference.apply_rope(q.double(), k.double(), positions, cos_sin.double(), layout)
    assert got_q.dtype == got_k.dtype == dtype
    assert_close(got_q, ref_q, dtype)
    assert_close(got_k, ref_k, dtype)
    dq, dk = _randn(q.shape, dtype, device, 2), _randn(k.shape, dtype, device, 3)
    qa, ka = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    torch.autograd.backward(kernels.apply_rope(qa, ka, positions, cos_sin, layout), (dq, dk))
    qr, kr = leaf(q), leaf(k)
    torch.autograd.backward(reference.apply_rope(qr, kr, positions, cos_sin.double(), layout), (dq.double(), dk.double()))
    assert_close(qa.grad, qr.grad, dtype)
    assert_close(ka.grad, kr.grad, dtype)


def _kv_step(dtype, device):
    """k, v for 5 tokens (one of them padding, slot -1), caches of noise and their float64 copies."""
    k, v = _randn((5, 2, 16), dtype, device, 0), _randn((5, 2, 16), dtype, device, 1)
    k_cache, v_cache = _randn((3, 4, 2, 16), dtype, device, 2), _randn((3, 4, 2, 16), dtype, device, 3)
    slots = torch.tensor([9, -1, 0, 4, 11], dtype=torch.int32, device=device)
    return k, v, k_cache, v_cache, slots


@over_dtypes
def test_store_kv(device, dtype):
    k, v, k_cache, v_cache, slots = _kv_step(dtype, device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, expected_k, expected_v, slots)
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@over_dtypes
def test_rope_and_store_kv(device, dtype):
    k, v, k_cache, v_cache, slots = _kv_step(dtype, device)
    q = _randn((5, 4, 16), dtype, device, 4)
    positions = torch.tensor([3, 0, 17, 5, 9], device=device)
    cos_sin = kernels.rope_cos_sin(20, 16, device=device, dtype=dtype)
    ref_k_cache, ref_v_cache = k_cache.double(), v_cache.double()
    ref_q, ref_k = reference.rope_and_store_kv(q.double(), k.double(), v.double(), positions, cos_sin.double(),
                                               ref_k_cache, ref_v_cache, slots)
    got_q, got_k = kernels.rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    assert got_q.dtype == got_k.dtype == dtype
    for got, expected in ((got_q, ref_q), (got_k, ref_k), (k_cache, ref_k_cache), (v_cache, ref_v_cache)):
        assert_close(got, expected, dtype)


@over_dtypes
@pytest.mark.parametrize("max_splits", [1, 4])  # the context in one program; split and merged
def test_decode_attention(device, dtype, max_splits):
    k_cache, v_cache = _randn((6, 16, 2, 32), dtype, device, 0), _randn((6, 16, 2, 32), dtype, device, 1)
    block_tables = torch.tensor([[4, 1, 5], [0, 3, 2]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([5, 40], dtype=torch.int32, device=device)
    q = _randn((2, 8, 32), dtype, device, 2)
    out = kernels.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_splits=max_splits)
    assert out.dtype == dtype
    expected = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens)
    assert_close(out, expected, dtype)


# --------------------------------------------------------------------------------------------
# flash attention
# --------------------------------------------------------------------------------------------


@over_dtypes
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention(device, dtype, causal):
    q = _randn((2, 2, 37, 16), dtype, device, 0)  # two query heads share a key/value head
    k, v = _randn((2, 1, 37, 16), dtype, device, 1), _randn((2, 1, 37, 16), dtype, device, 2)
    out = kernels.flash_attention(q, k, v, causal=causal)
    assert out.dtype == dtype
    assert_close(out, reference.attention(q.double(), k.double(), v.double(), causal=causal), dtype)
    _check_grads(lambda q, k, v: kernels.flash_attention(q, k, v, causal=causal),
                 lambda q, k, v: reference.attention(q, k, v, causal=causal),
                 (q, k, v), _randn(q.shape, dtype, device, 3), dtype, scale=4)


@over_dtypes
def test_flash_attention_varlen(device, dtype):
    cu = torch.tensor([0, 5, 5, 38], dtype=torch.int32, device=device)  # an empty sequence between two
    q = _randn((38, 2, 16), dtype, device, 0)
    k, v = _randn((38, 1, 16), dtype, device, 1), _randn((38, 1, 16), dtype, device, 2)
    out = kernels.flash_attention_varlen(q, k, v, cu, 33)
    assert out.dtype == dtype
    assert_close(out, reference.attention_varlen(q.double(), k.double(), v.double(), cu), dtype)
    _check_grads(lambda q, k, v: kernels.flash_attention_varlen(q, k, v, cu, 33),
                 lambda q, k, v: reference.attention_varlen(q, k, v, cu),
                 (q, k, v), _randn(q.shape, dtype, device, 3), dtype, scale=4)
