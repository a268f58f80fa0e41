import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPES, kernel_module

from fuselab.kernels.embedding import decode_embedding

VOCAB = 50
HIDDENS = (1, 7, 100, 1000, 2049)  # 2049: three blocks, the last of one column
ID_DTYPES = (torch.int32, torch.int64)


def _weight(vocab, hidden, dtype, device, seed=0):
    return torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _reference(weight, input_ids, last_tokens, prev_rows):
    """torch's decode step, in float64: the ids chosen on the device, then the lookup."""
    ids = torch.where(input_ids >= 0, input_ids, last_tokens[prev_rows])
    return F.embedding(ids.long(), weight.double())


def _masked_reference(weight, input_ids, last_tokens, prev_rows):
    """As the op documents it, row by row: a prev row or token out of range gives zeros."""
    out = torch.zeros(input_ids.shape[0], weight.shape[1], dtype=torch.float64)
    for i, token in enumerate(input_ids.tolist()):
        if token < 0:
            prev = prev_rows[i].item()
            token = last_tokens[prev].item() if 0 <= prev < last_tokens.shape[0] else -1
        if 0 <= token < weight.shape[0]:
            out[i] = weight[token].double().cpu()
    return out.to(weight.device)


def _check(weight, input_ids, last_tokens, prev_rows, expected):
    got = decode_embedding(weight, input_ids, last_tokens, prev_rows)
    assert got.dtype == weight.dtype and got.device == weight.device
    assert got.shape == (input_ids.shape[0], weight.shape[1])
    assert torch.equal(got, expected.to(weight.dtype))  # a copy: exact


def _ids(rows, n_last, id_dtype, device, seed):
    """input_ids with about half the rows negative (read from last_tokens), and valid prev_rows."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (rows,), generator=g)
    input_ids[torch.rand(rows, generator=g) < 0.5] = -1
    last_tokens = torch.randint(0, VOCAB, (n_last,), generator=g)
    prev_rows = torch.randint(0, n_last, (rows,), generator=g)
    return (input_ids.to(id_dtype).to(device), last_tokens.to(id_dtype).to(device),
            prev_rows.to(id_dtype).to(device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_matches_torch(device, dtype, hidden, rows):
    weight = _weight(VOCAB, hidden, dtype, device, seed=hidden)
    ids = _ids(rows, 8, torch.int64, device, seed=rows + hidden)
    _check(weight, *ids, _reference(weight, *ids))


@pytest.mark.parametrize("ids_dtype", ID_DTYPES)
@pytest.mark.parametrize("last_dtype", ID_DTYPES)
@pytest.mark.parametrize("prev_dtype", ID_DTYPES)
def test_int32_and_int64_ids(device, ids_dtype, last_dtype, prev_dtype):
    weight = _weight(VOCAB, 100, torch.bfloat16, device)
    input_ids, last_tokens, prev_rows = _ids(17, 5, torch.int64, device, seed=1)
    ids = (input_ids.to(ids_dtype), last_tokens.to(last_dtype), prev_rows.to(prev_dtype))
    _check(weight, *ids, _reference(weight, *ids))


def test_every_row_from_the_device_and_none(device):
    weight = _weight(VOCAB, 7, torch.float32, device)
    last_tokens = torch.tensor([3, 49, 0], device=device)
    prev_rows = torch.tensor([2, 0, 1, 1], device=device)
    from_device = torch.full((4,), -1, device=device)
    _check(weight, from_device, last_tokens, prev_rows, weight.double()[[0, 3, 49, 49]])
    given = torch.tensor([5, 0, 49, 5], device=device)
    _check(weight, given, last_tokens, prev_rows, weight.double()[[5, 0, 49, 5]])


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("hidden", [7, 2049])
def test_tokens_out_of_range_give_zero_rows(device, id_dtype, hidden):
    weight = _weight(VOCAB, hidden, torch.float16, device)
    big = 2**31 - 1
    input_ids = torch.tensor([VOCAB, -1, 3, big, -1, -1, -1, VOCAB - 1, -1], dtype=id_dtype, device=device)
    last_tokens = torch.tensor([7, -5, VOCAB, big, -(2**31)], dtype=id_dtype, device=device)
    # Rows 1, 4, 5 and 6 read a negative, a too large, a huge and the most negative last token; row 8 a valid one.
    prev_rows = torch.tensor([99, 1, -7, 0, 2, 3, 4, 0, 0], dtype=id_dtype, device=device)
    expected = _masked_reference(weight, input_ids, last_tokens, prev_rows)
    assert expected[[0, 1, 3, 4, 5, 6]].eq(0).all() and expected[[2, 7, 8]].ne(0).any(dim=1).all()
    _check(weight, input_ids, last_tokens, prev_rows, expected)


@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_prev_rows_out_of_range_give_zero_rows(device, id_dtype):
    weight = _weight(VOCAB, 100, torch.bfloat16, device)
    input_ids = torch.tensor([-1, -1, -1, 4, -1], dtype=id_dtype, device=device)
    last_tokens = torch.tensor([9, 11], dtype=id_dtype, device=device)
    # 2 is one past the end; -1 before the start; 2**31 - 1 far past; row 3's 1000 is never read.
    prev_rows = torch.tensor([2, -1, 2**31 - 1, 1000, 1], dtype=id_dtype, device=device)
    expected = torch.zeros(5, 100, dtype=torch.float64, device=device)
    expected[3], expected[4] = weight[4].double(), weight[11].double()
    _check(weight, input_ids, last_tokens, prev_rows, expected)
    # No last tokens at all: every row that asks for one gives zeros.
    empty = torch.empty(0, dtype=id_dtype, device=device)
    expected[4] = 0
    _check(weight, input_ids, empty, prev_rows, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_rows_strided(device, dtype):
    wide = _weight(2 * VOCAB, 1100, dtype, device)
    weight = wide[:VOCAB, 50:1049]  # a view: row stride 1100, 999 columns
    assert weight.stride() == (1100, 1) and not weight.is_contiguous()
    ids = _ids(17, 6, torch.int32, device, seed=3)
    _check(weight, *ids, _reference(weight, *ids))
    every_other = wide[::2, :7]  # VOCAB rows, two apart
    _check(every_other, *ids, _reference(every_other, *ids))


def test_strided_id_tensors(device):
    weight = _weight(VOCAB, 100, torch.float32, device)
    input_ids, last_tokens, prev_rows = (t.repeat_interleave(2)[::2] for t in _ids(9, 4, torch.int64, device, 5))
    assert input_ids.stride() == (2,)
    _check(weight, input_ids, last_tokens, prev_rows, _reference(weight, input_ids, last_tokens, prev_rows))


def test_blocks_smaller_than_a_row(device, monkeypatch):
    monkeypatch.setattr(kernel_module("embedding"), "MAX_BLOCK", 16)
    weight = _weight(VOCAB, 100, torch.float16, device)  # 7 blocks, the last of 4 columns
    ids = _ids(3, 4, torch.int64, device, seed=7)
    _check(weight, *ids, _reference(weight, *ids))


def test_zero_rows(device):
    weight = _weight(VOCAB, 7, torch.bfloat16, device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    got = decode_embedding(weight, empty, torch.zeros(3, dtype=torch.int64, device=device), empty)
    assert got.shape == (0, 7) and got.dtype == torch.bfloat16 and got.device == weight.device


def test_bad_inputs_raise_naming_the_argument(device):
    weight = _weight(VOCAB, 8, torch.float32, device)
    ids = torch.tensor([1, -1, 2], device=device)
    last = torch.tensor([4, 5], device=device)
    prev = torch.tensor([0, 1, 0], device=device)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        decode_embedding(weight.tolist(), ids, last, prev)
    with pytest.raises(TypeError, match="weight must be float32"):
        decode_embedding(weight.double(), ids, last, prev)
    with pytest.raises(TypeError, match="weight must be float32"):
        decode_embedding(weight.long(), ids, last, prev)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        decode_embedding(weight[0], ids, last, prev)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        decode_embedding(weight[None], ids, last, prev)
    with pytest.raises(ValueError, match=r"weight's rows must be contiguous \(stride\(1\) == 1\)"):
        decode_embedding(weight.t().contiguous().t(), ids, last, prev)
    for name, position in (("input_ids", 1), ("last_tokens", 2), ("prev_rows", 3)):
        args = [weight, ids, last, prev]
        t = args[position]
        for bad, error, message in (
            (t.tolist(), TypeError, f"{name} must be a torch.Tensor"),
            (t.float(), TypeError, f"{name} must be int32 or int64, got torch.float32"),
            (t.to(torch.int16), TypeError, f"{name} must be int32 or int64, got torch.int16"),
            (t.bool(), TypeError, f"{name} must be int32 or int64, got torch.bool"),
            (t[None], ValueError, f"{name} must be 1-D"),
            (t[0], ValueError, f"{name} must be 1-D"),
            (t.to("meta" if device.type == "cpu" else "cpu"), ValueError, f"{name} is on .* but weight is on"),
        ):
            args[position] = bad
            with pytest.raises(error, match=message):
                decode_embedding(*args)
    with pytest.raises(ValueError, match="prev_rows must have input_ids' length 3, got 2"):
        decode_embedding(weight, ids, last, prev[:2])
    with pytest.raises(ValueError, match="prev_rows must have input_ids' length 2, got 3"):
        decode_embedding(weight, ids[:2], last, prev)
