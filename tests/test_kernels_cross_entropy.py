import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_checks import DTYPES, assert_close, kernel_module, leaf, lower_block_cap

from fuselab.kernels import reference
from fuselab.kernels.cross_entropy import cross_entropy

VOCABS = (1, 3, 1000, 5003)
REDUCTIONS = ("mean", "sum", "none")


def _inputs(rows, vocab, dtype, device, seed=0, ignored=()):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype).to(device)
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[list(ignored)] = -100
    return logits, target.to(device)


def _reference(logits, target, **kw):
    return reference.cross_entropy(logits.double(), target, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_forward_matches_reference(device, dtype, vocab):
    logits, target = _inputs(4, vocab, dtype, device, ignored=[1])
    for reduction in REDUCTIONS:
        loss = cross_entropy(logits, target, reduction=reduction)
        assert loss.dtype == dtype
        assert_close(loss, _reference(logits, target, reduction=reduction), dtype)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_vocab_longer_than_one_chunk(device, monkeypatch, reduction, label_smoothing):
    lower_block_cap(monkeypatch, "cross_entropy", 128)
    logits, target = _inputs(3, 1000, torch.float32, device, ignored=[2])
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    assert_close(cross_entropy(logits, target, **kw), _reference(logits, target, **kw), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_backward_matches_autograd_of_reference(device, monkeypatch, dtype, reduction):
    lower_block_cap(monkeypatch, "cross_entropy", 256)
    logits, target = _inputs(5, 1000, dtype, device, ignored=[3])
    kw = dict(reduction=reduction, label_smoothing=0.1)
    # A non-unit incoming gradient exercises the rescaling that backward skips for d(loss) = 1.
    shape = (5,) if reduction == "none" else ()
    dloss = torch.rand(shape, generator=torch.Generator().manual_seed(1)).add(0.5)
    xk = logits.clone().requires_grad_(True)
    cross_entropy(xk, target, **kw).backward(dloss.to(dtype).to(device))
    xr = leaf(logits)
    _reference(xr, target, **kw).backward(dloss.to(dtype).double().to(device))
    assert xk.grad.dtype == dtype
    assert_close(xk.grad, xr.grad, dtype, scale=2)


def test_unit_incoming_gradient_is_the_stored_gradient(device):
    logits, target = _inputs(4, 300, torch.float32, device, ignored=[0])
    xk = logits.clone().requires_grad_(True)
    cross_entropy(xk, target).backward()
    xr = leaf(logits)
    _reference(xr, target).backward()
    assert_close(xk.grad, xr.grad, torch.float32)
    assert torch.all(xk.grad[0] == 0)


def test_every_row_ignored_gives_nan_mean_and_zero_gradient(device):
    logits, target = _inputs(3, 50, torch.float32, device, ignored=[0, 1, 2])
    xk = logits.clone().requires_grad_(True)
    loss = cross_entropy(xk, target, label_smoothing=0.2)
    loss.backward()
    assert torch.isnan(loss)
    assert torch.all(xk.grad == 0)
    assert cross_entropy(logits, target, reduction="sum") == 0


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_empty_batch(device, reduction):
    logits = torch.empty(0, 10, device=device)
    target = torch.empty(0, dtype=torch.long, device=device)
    got = cross_entropy(logits, target, reduction=reduction)
    expected = _reference(logits, target, reduction=reduction)
    assert got.shape == expected.shape
    torch.testing.assert_close(got.double(), expected, equal_nan=True)


def test_strided_logits_and_int32_target(device):
    wide, target = _inputs(4, 2000, torch.float32, device)
    logits = wide[:, ::2]  # column stride 2: copied once to make the rows contiguous
    target = (target % 1000).to(torch.int32)
    assert_close(cross_entropy(logits, target, reduction="none"), _reference(logits, target, reduction="none"), torch.float32)
    rows = wide[::2, :1000]  # row stride 4000, columns contiguous: read in place
    assert_close(cross_entropy(rows, target[:2]), _reference(rows, target[:2]), torch.float32)


def test_nan_and_inf_propagate_like_reference(device, monkeypatch):
    lower_block_cap(monkeypatch, "cross_entropy", 64)
    logits, target = _inputs(4, 200, torch.float32, device)
    logits[0, 7] = float("nan")
    logits[1, 150] = float("inf")
    logits[2, :] = float("-inf")
    got = cross_entropy(logits, target, reduction="none")
    expected = _reference(logits, target, reduction="none")
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    assert torch.isnan(got[:3]).all() and torch.isfinite(got[3])


def test_target_out_of_range_gives_nan_row(device):
    logits, target = _inputs(3, 20, torch.float32, device)
    target[1] = 20
    target[2] = -5
    loss = cross_entropy(logits, target, reduction="none")
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1:]).all()


def test_backward_twice_raises(device):
    logits, target = _inputs(2, 10, torch.float32, device)
    xk = logits.clone().requires_grad_(True)
    loss = cross_entropy(xk, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_inference_path_needs_no_grad(device):
    logits, target = _inputs(3, 100, torch.float32, device)
    xk = logits.clone().requires_grad_(True)
    with torch.no_grad():
        loss = cross_entropy(xk, target)
    assert loss.grad_fn is None
    assert_close(loss, _reference(logits, target), torch.float32)


def test_bad_inputs_name_the_argument(device):
    logits, target = _inputs(2, 10, torch.float32, device)
    cases = [
        (dict(logits=logits.double()), TypeError, "logits"),
        (dict(logits=logits.tolist()), TypeError, "logits"),
        (dict(target=target.float()), TypeError, "target"),
        (dict(target=target[:1]), ValueError, "target"),
        (dict(logits=logits[None]), ValueError, "logits"),
        (dict(logits=logits[:, :0], target=target), ValueError, "logits"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
        (dict(ignore_index=1.0), TypeError, "ignore_index"),
    ]
    for override, error, name in cases:
        kw = dict(logits=logits, target=target) | override
        with pytest.raises(error, match=name):
            cross_entropy(**kw)


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(1, 300),
    cap=st.sampled_from([16, 64, 512]),
    label_smoothing=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_reference(rows, vocab, cap, label_smoothing, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logits, target = _inputs(rows, vocab, torch.float32, device, seed=seed)
    with pytest.MonkeyPatch.context() as monkeypatch:
        lower_block_cap(monkeypatch, "cross_entropy", cap)
        xk = logits.clone().requires_grad_(True)
        loss = cross_entropy(xk, target, label_smoothing=label_smoothing)
        loss.backward()
    xr = leaf(logits)
    expected = _reference(xr, target, label_smoothing=label_smoothing)
    expected.backward()
    assert_close(loss, expected, torch.float32)
    assert_close(xk.grad, xr.grad, torch.float32)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_programs_walking_several_rows_match_reference(device, monkeypatch, reduction):
    """More rows than the gradient's grid has programs (one an SM): each program takes rows in turn,
    ignored ones among them, over a vocabulary of several chunks with a partial last one; the "mean"
    gradient's count of valid rows in several steps too."""
    lower_block_cap(monkeypatch, "cross_entropy", 32)
    monkeypatch.setattr(kernel_module("cross_entropy"), "_COUNT_BLOCK", 4)
    rows = 2 * kernel_module("_common.launch").sm_count(device) + 3
    logits, target = _inputs(rows, 301, torch.float32, device, seed=8, ignored=[0, 5, rows - 1])
    kw = dict(reduction=reduction, label_smoothing=0.1)
    shape = (rows,) if reduction == "none" else ()
    dloss = torch.rand(shape, generator=torch.Generator().manual_seed(9)).add(0.5).to(device)
    xk = logits.clone().requires_grad_(True)
    loss = cross_entropy(xk, target, **kw)
    loss.backward(dloss)
    xr = leaf(logits)
    expected = _reference(xr, target, **kw)
    expected.backward(dloss.double())
    assert_close(loss, expected, torch.float32)
    assert_close(xk.grad, xr.grad, torch.float32)
    assert torch.all(xk.grad[5] == 0)


def _split_rows(monkeypatch, chunk):
    """Cut every row into parts of `chunk` logits (the path decode-sized batches take), however few the
    SMs the launch config assumes."""
    ce = kernel_module("cross_entropy")
    monkeypatch.setattr(ce, "SPLIT_CHUNK", chunk)
    monkeypatch.setattr(ce, "_whole_rows_from", lambda sms, write_grad: 1 << 30)


def test_few_rows_are_split_over_the_vocabulary_and_many_are_not():
    ce = kernel_module("cross_entropy")
    vocab_splits, whole_from = ce._vocab_splits, ce._whole_rows_from
    loss_only, with_grad = whole_from(132, False), whole_from(132, True)
    assert (loss_only, with_grad) == (1056, 66)
    assert vocab_splits(1, 128256, 1024, 132, loss_only) == (126, 1024)
    parts, span = vocab_splits(32, 128256, 1024, 132, loss_only)
    assert parts * span >= 128256 > (parts - 1) * span and span % 1024 == 0 and parts > 1
    assert vocab_splits(2048, 128256, 1024, 132, loss_only) == (1, 128256)
    assert vocab_splits(1, 1000, 1024, 132, loss_only) == (1, 1000)  # one chunk: nothing to split
    assert vocab_splits(1024, 128256, 1024, 132, loss_only) == (2, 64512)
    # With the gradient, rows are walked whole from half as many rows as SMs.
    assert vocab_splits(66, 128256, 1024, 132, with_grad) == (1, 128256)
    assert vocab_splits(65, 128256, 1024, 132, with_grad)[0] > 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_split_rows_match_reference_forward_and_backward(device, monkeypatch, dtype, reduction, label_smoothing):
    _split_rows(monkeypatch, 32)
    logits, target = _inputs(3, 301, dtype, device, seed=4, ignored=[1])
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    assert_close(cross_entropy(logits, target, **kw), _reference(logits, target, **kw), dtype)
    shape = (3,) if reduction == "none" else ()
    dloss = torch.rand(shape, generator=torch.Generator().manual_seed(5)).add(0.5).to(dtype)
    xk = logits.clone().requires_grad_(True)
    cross_entropy(xk, target, **kw).backward(dloss.to(device))
    xr = leaf(logits)
    _reference(xr, target, **kw).backward(dloss.double().to(device))
    assert_close(xk.grad, xr.grad, dtype, scale=2)
    assert torch.all(xk.grad[1] == 0)


@pytest.mark.parametrize("split", [False, True])
def test_leading_chunk_of_minus_inf_logits_leaves_the_loss_finite(device, monkeypatch, split):
    """A row whose first chunk (or first part) is all -inf, as a vocabulary mask makes it: exp(-inf - -inf)
    must not poison the running sum."""
    lower_block_cap(monkeypatch, "cross_entropy", 64)
    _split_rows(monkeypatch, 32 if split else 1 << 20)
    logits, target = _inputs(2, 200, torch.float32, device, seed=6)
    logits[:, :100] = float("-inf")
    target[:] = torch.tensor([150, 20])  # the second row's target is masked out: infinite loss
    xk = logits.clone().requires_grad_(True)
    got = cross_entropy(xk, target, reduction="none")
    expected = _reference(logits, target, reduction="none")
    assert torch.isfinite(got[0]) and got[1] == float("inf")
    assert_close(got[:1], expected[:1], torch.float32)
    got[:1].sum().backward()
    xr = leaf(logits)
    _reference(xr, target, reduction="none")[:1].sum().backward()
    assert_close(xk.grad[0], xr.grad[0], torch.float32)


def test_split_rows_propagate_nan_inf_and_out_of_range_targets(device, monkeypatch):
    _split_rows(monkeypatch, 32)
    logits, target = _inputs(5, 200, torch.float32, device, seed=7)
    logits[0, 7] = float("nan")
    logits[1, 150] = float("inf")
    logits[2, :] = float("-inf")
    target[3] = 200
    got = cross_entropy(logits, target, reduction="none")
    assert torch.isnan(got[:4]).all() and torch.isfinite(got[4])
    assert_close(got[4:], _reference(logits[4:], target[4:], reduction="none"), torch.float32)
    every_ignored = torch.full_like(target, -100)
    assert torch.isnan(cross_entropy(logits, every_ignored)) and cross_entropy(logits, every_ignored, reduction="sum") == 0


hopper = kernel_module("cross_entropy").hopper
needs_hopper_module = pytest.mark.skipif(hopper is None, reason="this Triton has no Gluon")


@needs_hopper_module
def test_hopper_kernel_takes_only_the_layouts_it_was_built_for():
    x = torch.empty(64, 4096, dtype=torch.bfloat16)
    fits = hopper.layout_fits
    assert fits(x, 0.0) and fits(x.half(), 0.0)
    assert not fits(x.float(), 0.0)  # fp32 logits
    assert not fits(x, 0.1)  # label smoothing
    assert not fits(x[:, :4000], 0.0)  # rows strided
    assert not fits(torch.empty(64, 4008, dtype=torch.bfloat16), 0.0)  # vocabulary not a multiple of 32
    assert not hopper.supports(x, 0.0, sms=1)  # not a CUDA tensor


def _hopper_gpu() -> bool:
    return hopper is not None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_gpu(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("rows, vocab, dtype, reduction, held", [
    # streamed chunks read twice, the partial last one among them; rows not a multiple of programs
    (300, 100032, torch.bfloat16, "mean", 2),
    (300, 100032, torch.bfloat16, "sum", 8),  # every streamed chunk held in registers
    (133, 96, torch.float16, "sum", None),  # one partial chunk, 32-logit segments, ignored rows
    (1, 81920, torch.bfloat16, "none", None),  # ten chunks, one program
    (1100, 128256, torch.bfloat16, "mean", None),  # the size it was built for, taken without lowering ROWS_PER_SM
])
def test_gpu_hopper_kernel_matches_reference(monkeypatch, rows, vocab, dtype, reduction, held):
    if held is not None:
        monkeypatch.setattr(hopper, "_HELD", held)
    if rows < 1100:  # small cases: taken by the Hopper kernel instead of the split path or the Triton kernel
        monkeypatch.setattr(hopper, "ROWS_PER_SM", 0)
        monkeypatch.setattr(kernel_module("cross_entropy"), "_whole_rows_from", lambda sms, write_grad: 1)
    calls = []
    launch = hopper.cross_entropy_hopper
    monkeypatch.setattr(hopper, "cross_entropy_hopper", lambda *a: calls.append(1) or launch(*a))
    logits, target = _inputs(rows, vocab, dtype, "cuda", seed=rows, ignored=range(0, rows, 7) if rows > 1 else [])
    if rows > 2:
        logits[1, 5] = float("nan")  # a NaN row: NaN loss and gradient for that row only
    shape = (rows,) if reduction == "none" else ()
    dloss = torch.rand(shape, generator=torch.Generator().manual_seed(1)).add(0.5).to(dtype).cuda()
    xk = logits.clone().requires_grad_(True)
    loss = cross_entropy(xk, target, reduction=reduction)
    loss.backward(dloss)
    assert calls == [1]
    xr = leaf(logits)
    expected = _reference(xr, target, reduction=reduction)
    expected.backward(dloss.double())
    assert_close(loss, expected, dtype)
    assert_close(xk.grad, xr.grad, dtype, scale=2)
