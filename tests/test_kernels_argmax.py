import pytest
import torch
from kernel_checks import DTYPES, kernel_module

from fuselab.kernels import argmax, reference

CHUNK = kernel_module("argmax").CHUNK
# One row in a single chunk, and three widths that need the merge, the last over two chunks.
WIDTHS = (1, 7, 1000, 5003, 2 * CHUNK + 11)
INF, NAN = float("inf"), float("nan")


def _randn(shape, dtype, device, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _check(x: torch.Tensor) -> None:
    got = argmax(x)
    assert got.dtype == torch.int64 and got.device == x.device and got.shape == (x.shape[0],)
    assert got.tolist() == reference.argmax(x).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_matches_torch(device, dtype, width, rows):
    _check(_randn((rows, width), dtype, device, seed=width + rows))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_across_chunks_take_the_first(device, dtype):
    width = 2 * CHUNK + 11
    x = torch.zeros(4, width, dtype=dtype, device=device)
    x[0, [5, CHUNK + 3, 2 * CHUNK + 1]] = 2.0  # one maximum in every chunk
    x[1, [CHUNK + 3, 2 * CHUNK + 1]] = 2.0  # in the later chunks only
    x[2, [CHUNK - 1, CHUNK]] = 2.0  # either side of a chunk boundary
    x[3] = 1.0  # the whole row ties
    assert argmax(x).tolist() == [5, CHUNK + 3, CHUNK - 1, 0]
    _check(x)


def test_ties_within_a_chunk_take_the_first(device):
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [-0.0, 0.0, -1.0, 0.0], [INF, 1.0, INF, 0.0]], device=device)
    assert argmax(x).tolist() == [1, 0, 0]
    _check(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_is_the_maximum(device, dtype):
    width = 2 * CHUNK + 11
    x = _randn((5, width), dtype, device)
    x[0, 17] = NAN
    x[1, CHUNK + 2], x[1, 3] = NAN, INF  # +inf in an earlier chunk loses to a later NaN
    x[2, [2 * CHUNK + 5, CHUNK + 9]] = NAN  # two NaNs in different chunks: the first
    x[3, [40, 41]] = NAN  # two in one chunk
    x[4] = NAN
    assert argmax(x).tolist() == [17, CHUNK + 2, CHUNK + 9, 40, 0]
    _check(x)


@pytest.mark.parametrize("width", [7, 2 * CHUNK + 11])
def test_rows_of_minus_inf(device, width):
    x = torch.full((3, width), -INF, device=device)
    x[1, width - 1] = -1e30  # the only finite value, in the last chunk
    x[2, 0] = NAN
    assert argmax(x).tolist() == [0, width - 1, 0]
    _check(x)


def test_many_chunks_and_a_looped_merge(device, monkeypatch):
    # Small chunks and merge blocks reach the looped merge: 9 chunks in steps of 4.
    monkeypatch.setattr(kernel_module("argmax"), "CHUNK", 16)
    monkeypatch.setattr(kernel_module("argmax"), "MAX_MERGE_BLOCK", 4)
    x = _randn((3, 140), torch.float32, device)
    x[1, [33, 130]] = 9.0
    x[2, [70, 139]] = NAN
    assert argmax(x).tolist()[1:] == [33, 70]
    _check(x)


@pytest.fixture
def small_chunks(monkeypatch):
    """16-column chunks, merged 4 a step: many chunks and a looped merge at small widths."""
    monkeypatch.setattr(kernel_module("argmax"), "CHUNK", 16)
    monkeypatch.setattr(kernel_module("argmax"), "MAX_MERGE_BLOCK", 4)


def test_ties_and_nans_across_many_chunk_boundaries(device, small_chunks):
    x = torch.zeros(7, 200, device=device)  # 13 chunks
    x[0, [15, 16, 199]] = 5.0  # a tie either side of the first boundary and in the last chunk
    x[1, [47, 48, 63, 64]] = 5.0  # ties at two boundaries: the first
    x[2, [160, 32]] = NAN  # the first NaN, in an earlier chunk than the later one
    x[3, 5], x[3, 191] = INF, NAN  # a NaN in the last chunk beats +inf in the first
    x[4] = -INF
    x[4, 112] = NAN
    x[5, 199] = 1.0  # the last column alone
    x[6] = 3.0  # the whole row ties
    assert argmax(x).tolist() == [15, 47, 32, 191, 112, 199, 0]
    _check(x)


@pytest.mark.parametrize("width", [16, 17, 140, 1000])
def test_given_counters_are_left_at_zero_and_reused(device, small_chunks, width):
    x = _randn((5, width), torch.float32, device, seed=width)
    counters = torch.zeros(8, dtype=torch.int32, device=device)  # more than the 5 needed is fine
    first = argmax(x, counters=counters)
    assert first.tolist() == reference.argmax(x).tolist()
    assert not counters.any()
    assert torch.equal(argmax(x, counters=counters), first)
    assert torch.equal(argmax(x, counters=counters[:5]), first)  # exactly as many as needed
    assert not counters.any()
    y = _randn((5, width), torch.float32, device, seed=width + 1)
    assert argmax(y, counters=counters).tolist() == reference.argmax(y).tolist()  # other data, same buffer


def test_repeated_calls_are_identical(device, small_chunks):
    x = _randn((4, 333), torch.bfloat16, device)
    x[:, ::7] = x[:, :1]  # many ties
    runs = [argmax(x) for _ in range(3)]
    assert all(torch.equal(run, runs[0]) for run in runs)


def test_bad_counters_raise_naming_them(device):
    x = torch.randn(3, 8, device=device)
    with pytest.raises(TypeError, match="counters must be a torch.Tensor"):
        argmax(x, counters=[0, 0, 0])
    with pytest.raises(TypeError, match="counters must be int32"):
        argmax(x, counters=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="counters has 2 elements but this call needs at least 3"):
        argmax(x, counters=torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="counters must be contiguous"):
        argmax(x, counters=torch.zeros(6, dtype=torch.int32, device=device)[::2])
    elsewhere = "meta" if device.type == "cpu" else "cpu"
    with pytest.raises(ValueError, match="counters is on"):
        argmax(x, counters=torch.zeros(3, dtype=torch.int32, device=elsewhere))


def test_strided_rows_and_columns(device):
    wide = _randn((4, 3 * CHUNK), torch.bfloat16, device)
    _check(wide[:, 5 : 2 * CHUNK + 100])  # a column slice: strided rows, read in place
    _check(wide[::2, :1000])
    _check(_randn((CHUNK + 3, 3), torch.float16, device).t())  # a column stride: copied


def test_empty_rows(device):
    got = argmax(torch.empty(0, 5, device=device))
    assert got.dtype == torch.int64 and got.shape == (0,)


def test_bad_inputs_raise_naming_the_argument(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        argmax(x.tolist())
    with pytest.raises(TypeError, match="x must be float32"):
        argmax(x.long())
    with pytest.raises(TypeError, match="x must be float32"):
        argmax(x.double())
    with pytest.raises(ValueError, match="x must be 2-D"):
        argmax(x[0])
    with pytest.raises(ValueError, match="x must be 2-D"):
        argmax(x[None])
    with pytest.raises(ValueError, match="x must have at least one column"):
        argmax(torch.empty(3, 0, device=device))
    with pytest.raises(ValueError, match="x must have at least one column"):
        argmax(torch.empty(0, 0, device=device))


@pytest.mark.parametrize("width", [7, 5003, 2 * CHUNK + 11])
def test_out_is_written_and_returned(device, width):
    x = _randn((3, width), torch.bfloat16, device, seed=width)
    tokens = torch.full((5,), -7, dtype=torch.int64, device=device)  # a wider buffer: its first 3 slots
    got = argmax(x, counters=torch.zeros(3, dtype=torch.int32, device=device), out=tokens[:3])
    assert got.data_ptr() == tokens.data_ptr()
    assert tokens[:3].tolist() == reference.argmax(x).tolist() and tokens[3:].tolist() == [-7, -7]
    assert torch.equal(argmax(x, out=torch.empty(3, dtype=torch.int64, device=device)), got)


def test_bad_out_raises_naming_it(device):
    x = torch.randn(3, 8, device=device)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        argmax(x, out=[0, 0, 0])
    with pytest.raises(TypeError, match="out must be int64"):
        argmax(x, out=torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"out must have shape \(3,\)"):
        argmax(x, out=torch.zeros(4, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="out must have a unit stride"):
        argmax(x, out=torch.zeros(6, dtype=torch.int64, device=device)[::2])
    elsewhere = "meta" if device.type == "cpu" else "cpu"
    with pytest.raises(ValueError, match="out is on"):
        argmax(x, out=torch.zeros(3, dtype=torch.int64, device=elsewhere))
