import importlib
import math

import pytest
import torch
from kernel_checks import assert_close, kernel_module, leaf

from fuselab.kernels import flash_attention, flash_attention_varlen, reference
from fuselab.kernels.attention.common import INTERPRETER_FORWARD

# On the CPU the interpreter runs 32-row query blocks against 16-key blocks, so these lengths cross
# block edges, the causal diagonal spanning two key blocks, and a partial last block.
SEQ_LENS = (1, 7, 129)

HALF_DTYPES = (torch.float16, torch.bfloat16)


def _randn(shape, dtype, device, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _qkv(batch, heads, kv_heads, seq, head_dim, dtype, device, seq_k=None):
    seq_k = seq if seq_k is None else seq_k
    return (
        _randn((batch, heads, seq, head_dim), dtype, device, 0),
        _randn((batch, kv_heads, seq_k, head_dim), dtype, device, 1),
        _randn((batch, kv_heads, seq_k, head_dim), dtype, device, 2),
    )


def _check_backward(fn, ref_fn, inputs, dout, dtype, scale=1.0):
    """Gradients of fn(*inputs) against autograd of ref_fn on float64 copies."""
    ours = [t.clone().requires_grad_(True) for t in inputs]
    fn(*ours).backward(dout)
    theirs = [leaf(t) for t in inputs]
    ref_fn(*theirs).backward(dout.double())
    for name, a, b in zip("qkv", ours, theirs):
        assert a.grad.shape == b.grad.shape, name
        assert_close(a.grad, b.grad, dtype, scale)


# --------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq", SEQ_LENS)
def test_forward_matches_reference(device, causal, seq):
    q, k, v = _qkv(2, 2, 2, seq, 16, torch.float32, device)
    out = flash_attention(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, reference.attention(q.double(), k.double(), v.double(), causal=causal), torch.float32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq,group", [(1, 1), (7, 4), (129, 2)])
def test_forward_through_tma_descriptors_matches_reference(device, monkeypatch, causal, seq, group):
    """The TMA kernel: tails past the sequence arrive as zeros and are masked; GQA heads find their kv head."""
    module = kernel_module("attention.flash_forward")
    cfg = module.forward_config(32)
    if device.type == "cuda":
        cfg = cfg._replace(block_m=64, block_n=32, num_warps=4, num_stages=2)
    monkeypatch.setattr(module, "tma_forward_config", lambda head_dim, causal, seq_q: cfg)
    launched = []
    kernel = module._flash_forward_tma_kernel
    monkeypatch.setattr(module, "_flash_forward_tma_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (launched.append(grid), kernel[grid])[1],
        "__getattr__": lambda self, name: getattr(kernel, name)})())
    q, k, v = _qkv(2, 4, 4 // group, seq, 32, torch.float16, device)
    expected = reference.attention(q.double(), k.double(), v.double(), causal=causal)
    assert_close(flash_attention(q, k, v, causal=causal), expected, torch.float16)
    assert launched


def test_long_causal_sequences_take_the_non_causal_tiles(monkeypatch):
    common = importlib.import_module("fuselab.kernels.attention.common")
    monkeypatch.setattr(common, "INTERPRETED", False)
    short, long = common.LONG_CAUSAL_SEQ - 1, common.LONG_CAUSAL_SEQ
    assert common.tma_forward_config(128, True, short) == common.TMA_FORWARD_CONFIGS[(128, True)]
    assert common.tma_forward_config(128, True, long) == common.TMA_FORWARD_CONFIGS[(128, False)]
    assert common.tma_forward_config(128, False, short) == common.TMA_FORWARD_CONFIGS[(128, False)]
    assert common.tma_forward_config(64, True, long) is None


def test_tma_path_is_skipped_for_layouts_it_cannot_describe(device, monkeypatch):
    module = kernel_module("attention.flash_forward")
    monkeypatch.setattr(module, "tma_forward_config", lambda head_dim, causal, seq_q: module.forward_config(head_dim))
    monkeypatch.setattr(module, "_flash_forward_tma_kernel", None)  # would fail if used
    cases = [
        _qkv(1, 2, 2, 20, 80, torch.float16, device),  # head dim 80: padded to 128
        _qkv(1, 2, 2, 20, 32, torch.float32, device),  # fp32: tiles sized for 16-bit types
        [t.transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv(1, 2, 2, 20, 32, torch.float16, device)],
        # Contiguous, but 2 bytes past a 16-byte boundary.
        [torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape) for t in _qkv(1, 2, 2, 20, 32, torch.float16, device)],
    ]
    assert cases[3][0].is_contiguous() and cases[3][0].data_ptr() % 16 == 2
    for q, k, v in cases:
        expected = reference.attention(q.double(), k.double(), v.double(), causal=True)
        assert_close(flash_attention(q, k, v), expected, q.dtype)


# --------------------------------------------------------------------------------------------
# a last wave of few tiles, split along the keys
# --------------------------------------------------------------------------------------------


def test_tail_split_fills_the_last_wave_with_parts_of_its_tiles():
    tail_split = kernel_module("attention.flash_forward").tail_split
    # 32k tokens x 16 heads in 128-row tiles on 132 SMs: 4 tiles past 31 waves, cut into 32 parts each.
    assert tail_split(4096, 132, 32) == (4092, 32, 1)
    assert tail_split(4096, 132, 128) == (4092, 32, 4)
    assert tail_split(10, 4, 7) == (8, 2, 4)
    assert tail_split(12, 11, 7) == (11, 7, 1)
    for tiles, slots, blocks in ((132, 132, 32), (100, 132, 32), (264, 132, 32), (200, 132, 32), (133, 132, 1)):
        # One wave or less, waves all full, a last wave over half full, or one key block: nothing to cut.
        assert tail_split(tiles, slots, blocks) == (tiles, 1, blocks)


def _split_forward_spy(monkeypatch, module, slots):
    """Make the forward believe `slots` programs run at once, one an SM, and record the merge kernel's grids."""
    monkeypatch.setattr(module, "_slots", lambda *args, **kwargs: slots)
    monkeypatch.setattr(module, "sm_count", lambda device: slots)
    merges, merge = [], module._merge_parts_kernel
    monkeypatch.setattr(module, "_merge_parts_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (merges.append(grid), merge[grid])[1]})())
    return merges


@pytest.mark.parametrize("slots", [5, 11])
@pytest.mark.parametrize("group", [1, 3])
def test_split_last_wave_matches_reference(device, monkeypatch, slots, group):
    """100 keys are 6 whole 16-key blocks and a partial one: parts of 1 and 4 blocks, the tail in the last."""
    module = kernel_module("attention.flash_forward")
    merges = _split_forward_spy(monkeypatch, module, slots)
    inputs = _qkv(1, 3, 3 // group, 100, 16, torch.float32, device)
    if device.type == "cuda":  # the interpreter's tiles, so that 4 query blocks x 3 heads are 12 tiles there too
        monkeypatch.setattr(module, "forward_config", lambda head_dim: INTERPRETER_FORWARD._replace(num_warps=4))
    out = flash_attention(*inputs, causal=False)
    assert merges == [(2 if slots == 5 else 1, 1)]
    assert_close(out, reference.attention(*(t.double() for t in inputs), causal=False), torch.float32)
    # The backward reads the merged log-sum-exp.
    dout = _randn(inputs[0].shape, torch.float32, device, 3)
    _check_backward(lambda q, k, v: flash_attention(q, k, v, causal=False),
                    lambda q, k, v: reference.attention(q, k, v, causal=False), inputs, dout, torch.float32)


def test_split_last_wave_through_tma_descriptors(device, monkeypatch):
    module = kernel_module("attention.flash_forward")
    cfg = module.forward_config(32)
    if device.type == "cuda":
        cfg = cfg._replace(block_m=64, block_n=32, num_warps=4, num_stages=2)
    monkeypatch.setattr(module, "tma_forward_config", lambda head_dim, causal, seq_q: cfg)
    q, k, v = _qkv(2, 4, 2, 129, 32, torch.float16, device)
    tiles = 2 * 4 * -(-129 // cfg.block_m)
    merges = _split_forward_spy(monkeypatch, module, tiles - 1)
    out = flash_attention(q, k, v, causal=False)
    assert merges and merges[0][0] == 1
    assert_close(out, reference.attention(q.double(), k.double(), v.double(), causal=False), torch.float16)


def test_causal_packed_and_shared_sm_tiles_are_not_split(device, monkeypatch):
    module = kernel_module("attention.flash_forward")
    merges = _split_forward_spy(monkeypatch, module, 11)
    flash_attention(*_qkv(1, 3, 3, 100, 16, torch.float32, device), causal=True)
    q, k, v, cu = _packed([100, 100, 100], 1, 1, 16, device)
    flash_attention_varlen(q, k, v, cu, 100, causal=False)
    monkeypatch.setattr(module, "sm_count", lambda device: 6)  # 11 programs at once on 6 SMs: some share one
    flash_attention(*_qkv(1, 3, 3, 100, 16, torch.float32, device), causal=False)
    assert merges == []


@pytest.mark.parametrize("group", [1, 4, 8])
def test_grouped_query_heads_read_their_shared_kv_head(device, group):
    q, k, v = _qkv(1, 8, 8 // group, 40, 32, torch.float32, device)
    expected = reference.attention(q.double(), k.double(), v.double(), causal=True)
    assert_close(flash_attention(q, k, v), expected, torch.float32)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_forward(device, dtype):
    q, k, v = _qkv(1, 4, 2, 50, 32, dtype, device)
    out = flash_attention(q, k, v, causal=True)
    assert out.dtype == dtype
    assert_close(out, reference.attention(q.double(), k.double(), v.double(), causal=True), dtype)


def test_padded_head_dim_and_custom_scale(device):
    # 80 is not a power of two: the kernels pad the head to 128 and mask the extra columns.
    q, k, v = _qkv(1, 2, 1, 20, 80, torch.float32, device)
    out = flash_attention(q, k, v, causal=False, scale=0.3)
    assert_close(out, reference.attention(q.double(), k.double(), v.double(), causal=False, scale=0.3), torch.float32)


def test_cross_attention_with_more_keys_than_queries(device):
    q, k, v = _qkv(1, 2, 2, 5, 16, torch.float32, device, seq_k=37)
    expected = reference.attention(q.double(), k.double(), v.double(), causal=False)
    assert_close(flash_attention(q, k, v, causal=False), expected, torch.float32)


def test_strided_inputs_in_sequence_major_layout(device):
    # [batch, seq, heads, d] viewed as [batch, heads, seq, d]: read in place, no copy.
    q, k, v = (_randn((2, 19, 4, 16), torch.float32, device, s).transpose(1, 2) for s in range(3))
    expected = reference.attention(q.double(), k.double(), v.double(), causal=True)
    assert_close(flash_attention(q, k, v), expected, torch.float32)


def test_causal_row_ignores_later_keys(device):
    # Changing the last key must leave every earlier query row untouched.
    q, k, v = _qkv(1, 1, 1, 33, 16, torch.float32, device)
    before = flash_attention(q, k, v)
    k[:, :, -1] += 10.0
    v[:, :, -1] -= 10.0
    after = flash_attention(q, k, v)
    torch.testing.assert_close(after[:, :, :-1], before[:, :, :-1], rtol=0, atol=0)
    assert not torch.allclose(after[:, :, -1], before[:, :, -1])


# --------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq", SEQ_LENS)
def test_backward_matches_autograd_of_reference(device, causal, seq):
    inputs = _qkv(1, 2, 2, seq, 16, torch.float32, device)
    dout = _randn(inputs[0].shape, torch.float32, device, 3)
    _check_backward(lambda q, k, v: flash_attention(q, k, v, causal=causal),
                    lambda q, k, v: reference.attention(q, k, v, causal=causal), inputs, dout, torch.float32)


@pytest.mark.parametrize("group", [4, 8])
def test_grouped_query_backward_sums_the_group_into_dk_dv(device, group):
    inputs = _qkv(1, 8, 8 // group, 45, 16, torch.float32, device)
    dout = _randn(inputs[0].shape, torch.float32, device, 3)
    _check_backward(flash_attention, reference.attention, inputs, dout, torch.float32)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_precision_backward(device, dtype):
    inputs = _qkv(1, 4, 2, 40, 32, dtype, device)
    dout = _randn(inputs[0].shape, dtype, device, 3)
    # Each gradient sums half-precision products over the sequence: allow a few roundings.
    _check_backward(flash_attention, reference.attention, inputs, dout, dtype, scale=4.0)


# --------------------------------------------------------------------------------------------
# variable length
# --------------------------------------------------------------------------------------------


def _packed(lengths, heads, kv_heads, head_dim, device):
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total = int(sum(lengths))
    q = _randn((total, heads, head_dim), torch.float32, device, 0)
    k = _randn((total, kv_heads, head_dim), torch.float32, device, 1)
    v = _randn((total, kv_heads, head_dim), torch.float32, device, 2)
    return q, k, v, cu_seqlens


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_matches_reference_per_sequence(device, causal):
    lengths = [1, 7, 0, 129, 20]
    q, k, v, cu = _packed(lengths, 4, 1, 16, device)
    out = flash_attention_varlen(q, k, v, cu, max(lengths), causal=causal)
    assert_close(out, reference.attention_varlen(q.double(), k.double(), v.double(), cu, causal=causal), torch.float32)


def test_varlen_backward_matches_autograd_of_reference(device):
    lengths = [33, 1, 18]
    q, k, v, cu = _packed(lengths, 4, 2, 16, device)
    dout = _randn(q.shape, torch.float32, device, 3)
    _check_backward(lambda q, k, v: flash_attention_varlen(q, k, v, cu, max(lengths)),
                    lambda q, k, v: reference.attention_varlen(q, k, v, cu), (q, k, v), dout, torch.float32)


def test_varlen_equals_padded_calls_one_sequence_at_a_time(device):
    lengths = [9, 30]
    q, k, v, cu = _packed(lengths, 2, 2, 16, device)
    packed = flash_attention_varlen(q, k, v, cu, max(lengths))
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        one = flash_attention(*(t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)))
        torch.testing.assert_close(packed[start:end], one[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------


def test_bad_inputs_raise_naming_the_argument(device):
    q, k, v = _qkv(1, 4, 2, 8, 16, torch.float32, device)
    with pytest.raises(ValueError, match="head dim 24"):
        flash_attention(*_qkv(1, 2, 2, 8, 24, torch.float32, device))
    with pytest.raises(TypeError, match="q must be float32"):
        flash_attention(q.long(), k, v)
    with pytest.raises(TypeError, match="k has dtype"):
        flash_attention(q, k.half(), v)
    with pytest.raises(ValueError, match="v has shape"):
        flash_attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="whole multiple of k's 3 heads"):
        flash_attention(q, k[:, :1].expand(1, 3, 8, 16), v[:, :1].expand(1, 3, 8, 16))
    with pytest.raises(ValueError, match="k has head dim"):
        flash_attention(q, torch.zeros(1, 2, 8, 32, device=device), torch.zeros(1, 2, 8, 32, device=device))
    with pytest.raises(ValueError, match="q must be"):
        flash_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="causal attention needs as many keys"):
        flash_attention(q, k[:, :, :5], v[:, :, :5], causal=True)
    with pytest.raises(ValueError, match="scale must be a positive"):
        flash_attention(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="k has 2 batch"):
        flash_attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    elsewhere = k.to("meta") if device.type == "cpu" else k.cpu()
    with pytest.raises(ValueError, match=f"k must be a {device.type} tensor"):
        flash_attention(q, elsewhere, v)


def test_bad_varlen_inputs_raise_naming_the_argument(device):
    q, k, v, cu = _packed([3, 4], 2, 2, 16, device)
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        flash_attention_varlen(q, k, v, cu.long(), 4)
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        flash_attention_varlen(q, k, v, [0, 3, 7], 4)
    with pytest.raises(ValueError, match="max_seqlen"):
        flash_attention_varlen(q, k, v, cu, 4.0)
    with pytest.raises(ValueError, match="k has 6 tokens"):
        flash_attention_varlen(q, k[:6], v[:6], cu, 4)


# --------------------------------------------------------------------------------------------
# The Hopper forward (Gluon)
# --------------------------------------------------------------------------------------------

hopper = kernel_module("attention.flash_forward").hopper
needs_hopper_module = pytest.mark.skipif(hopper is None, reason="this Triton has no Gluon")


@needs_hopper_module
def test_hopper_forward_takes_only_the_layouts_it_was_built_for():
    def qkv(seq=256, seq_k=None, head_dim=128, dtype=torch.bfloat16):
        return _qkv(1, 2, 2, seq, head_dim, dtype, "cpu", seq_k)

    fits = hopper.layout_fits
    assert fits(*qkv(), causal=True) and fits(*qkv(dtype=torch.float16), causal=False)
    assert fits(*qkv(256, 640), causal=False)  # cross-attention: key blocks of their own count
    assert not fits(*qkv(256, 640), causal=True)  # causal needs as many keys as queries
    assert not fits(*qkv(200), causal=False)  # not a whole number of 128-row blocks
    assert not fits(*qkv(256, 200), causal=False)
    assert not fits(*qkv(head_dim=64), causal=False)
    assert not fits(*qkv(dtype=torch.float32), causal=False)
    q, k, v = qkv()
    assert not fits(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, causal=False)  # sequence-major view
    assert not hopper.supports(q, k, v, causal=False)  # not a CUDA tensor


def _hopper_gpu() -> bool:
    return hopper is not None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,heads,kv_heads,seq,seq_k", [(1, 2, 2, 128, 128), (2, 4, 1, 384, 384),
                                                           (1, 3, 3, 256, 640)])
def test_gpu_hopper_forward_matches_reference(monkeypatch, causal, dtype, batch, heads, kv_heads, seq, seq_k):
    """One key block (both warpgroups' first and last turn at once), several with the ring wrapping,
    GQA, more keys than queries; the log-sum-exp the backward reads included."""
    if causal and seq != seq_k:
        pytest.skip("causal attention needs as many keys as queries")
    calls = []
    forward = hopper.flash_forward_hopper
    monkeypatch.setattr(hopper, "flash_forward_hopper", lambda *a: (calls.append(a[3]), forward(*a))[1])
    torch.manual_seed(0)
    q, k, v = _qkv(batch, heads, kv_heads, seq, 128, dtype, "cuda", seq_k)
    out = flash_attention(q, k, v, causal=causal, scale=0.05)
    assert calls == [causal]
    kf, vf = (t.float().repeat_interleave(heads // kv_heads, 1) for t in (k, v))
    assert_close(out, reference.attention(q.float(), kf, vf, causal=causal, scale=0.05), dtype)
    _, lse = forward(q, k, v, causal, 0.05)
    scores = q.float() @ kf.transpose(-1, -2) * 0.05
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq_k, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1) / math.log(2), rtol=1e-4, atol=1e-3)


# --------------------------------------------------------------------------------------------
# GPU, at real sizes
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_forward_backward_at_real_size(head_dim, causal):
    torch.manual_seed(0)
    q, k, v = _qkv(2, 8, 2, 1024, head_dim, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flash_attention(*ours, causal=causal)
    out.backward(dout)
    # fp32 math on the GPU is the reference at this size (float64 matmuls are slow there).
    theirs = [t.float().requires_grad_(True) for t in (q, k, v)]
    expected = reference.attention(*theirs, causal=causal)
    expected.backward(dout.float())
    assert_close(out, expected, torch.bfloat16)
    for a, b in zip(ours, theirs):
        assert_close(a.grad, b.grad, torch.bfloat16, scale=4.0)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_gpu_forward_matches_sdpa(head_dim):
    torch.manual_seed(0)
    q, k, v = _qkv(2, 16, 16, 2048, head_dim, torch.bfloat16, "cuda")
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(flash_attention(q, k, v), expected, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_varlen_forward_backward():
    torch.manual_seed(0)
    lengths = [1, 17, 1000, 513, 2048]
    q, k, v, cu = _packed(lengths, 8, 2, 128, "cuda")
    q, k, v = (t.bfloat16() for t in (q, k, v))
    dout = torch.randn_like(q)
    _check_backward(lambda q, k, v: flash_attention_varlen(q, k, v, cu, max(lengths)),
                    lambda q, k, v: reference.attention_varlen(q, k, v, cu), (q, k, v), dout, torch.bfloat16, scale=4.0)


@pytest.mark.gpu
def test_gpu_last_wave_split_at_real_size(monkeypatch):
    """One more 128-row tile than the SMs hold at d=128 (one program an SM: three stages of 128x128 K and V
    tiles fill the shared memory): the last wave's tiles are split, and the result still matches."""
    module = kernel_module("attention.flash_forward")
    merges, merge = [], module._merge_parts_kernel
    monkeypatch.setattr(module, "_merge_parts_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (merges.append(grid), merge[grid])[1]})())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    q, k, v = _qkv(1, sms + 1, sms + 1, 128, 128, torch.bfloat16, "cuda", seq_k=1000)
    out = flash_attention(q, k, v, causal=False)
    assert merges == [(1, 128 // module._MERGE_ROWS)]
    assert_close(out, reference.attention(q.float(), k.float(), v.float(), causal=False), torch.bfloat16)
