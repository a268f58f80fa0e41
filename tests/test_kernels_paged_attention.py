import pytest
import torch
from kernel_checks import assert_close, kernel_module

from fuselab.kernels import decode_attention, reference, store_kv

paged = kernel_module("attention.paged_attention")


def _randn(shape, dtype, device, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _paged_cache(lengths, kv_heads, head_dim, block_size, dtype, device, spare_blocks=3, seed=0):
    """Caches of random tokens and a shuffled block table: a sequence's blocks are scattered."""
    blocks_per_seq = max(1, -(-max(lengths) // block_size))
    num_blocks = len(lengths) * blocks_per_seq + spare_blocks
    k_cache = _randn((num_blocks, block_size, kv_heads, head_dim), dtype, device, seed)
    v_cache = _randn((num_blocks, block_size, kv_heads, head_dim), dtype, device, seed + 1)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    block_tables = order[: len(lengths) * blocks_per_seq].view(len(lengths), blocks_per_seq).to(torch.int32).to(device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, seq_lens


def _check_decode(device, lengths, heads, kv_heads, head_dim, block_size, dtype=torch.float32, **kwargs):
    k_cache, v_cache, block_tables, seq_lens = _paged_cache(lengths, kv_heads, head_dim, block_size, dtype, device)
    q = _randn((len(lengths), heads, head_dim), dtype, device, 7)
    out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, **kwargs)
    assert out.shape == q.shape and out.dtype == dtype
    expected = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens,
                                          scale=kwargs.get("scale"))
    assert_close(out, expected, dtype)


@pytest.fixture
def short_splits(monkeypatch):
    """Split contexts of a few dozen tokens, so small tests run several splits per sequence."""
    monkeypatch.setattr(paged, "MIN_TOKENS_PER_SPLIT", 16)


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_reference_for_each_gqa_ratio(device, short_splits, group):
    _check_decode(device, [1, 40, 129], heads=8, kv_heads=8 // group, head_dim=32, block_size=16)


@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_sequences_shorter_than_one_block(device, short_splits, block_size):
    _check_decode(device, [1, 7, 15], heads=4, kv_heads=2, head_dim=16, block_size=block_size)


@pytest.mark.parametrize("max_splits", [1, 3, 32])
def test_decode_is_the_same_for_any_split_count(device, short_splits, max_splits):
    _check_decode(device, [100, 37], heads=4, kv_heads=1, head_dim=16, block_size=16, max_splits=max_splits)


@pytest.mark.parametrize("max_splits", [1, 4])
def test_decode_of_an_empty_context_is_zero_with_or_without_a_merge(device, short_splits, max_splits):
    k_cache, v_cache, block_tables, _ = _paged_cache([40, 40], 2, 16, 16, torch.float32, device)
    seq_lens = torch.tensor([0, 40], dtype=torch.int32, device=device)
    q = _randn((2, 4, 16), torch.float32, device, 7)
    out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_splits=max_splits)
    assert not out[0].any()
    expected = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens)
    assert_close(out[1], expected[1], torch.float32)


def test_decode_with_more_splits_than_blocks_leaves_empty_splits_out(device, short_splits):
    # 200 tokens of capacity ask for many splits; a 3-token sequence fills only the first.
    _check_decode(device, [3, 20], heads=2, kv_heads=2, head_dim=16, block_size=16, max_seq_len=200, max_splits=8)


def test_decode_of_an_empty_context_is_zero(device, short_splits):
    k_cache, v_cache, block_tables, _ = _paged_cache([16, 16], 2, 16, 16, torch.float32, device)
    seq_lens = torch.tensor([0, 5], dtype=torch.int32, device=device)
    q = _randn((2, 2, 16), torch.float32, device, 7)
    out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out).all()


def test_decode_half_precision_padded_head_dim_and_scale(device, short_splits):
    _check_decode(device, [50, 9], heads=4, kv_heads=2, head_dim=80, block_size=32, dtype=torch.float16, scale=0.2)


def test_decode_reads_only_the_first_seq_len_tokens(device, short_splits):
    k_cache, v_cache, block_tables, seq_lens = _paged_cache([20], 1, 16, 16, torch.float32, device)
    q = _randn((1, 1, 16), torch.float32, device, 7)
    before = decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    last_block = block_tables[0, 1]
    k_cache[last_block, 4:] = 1e4  # tokens 20..31 of the sequence: past its length
    assert torch.equal(decode_attention(q, k_cache, v_cache, block_tables, seq_lens), before)


def test_split_count_comes_from_static_sizes(device):
    many = paged.num_splits(batch=1, kv_heads=8, max_seq_len=32768, max_splits=32, device=torch.device("cuda", 0)) \
        if torch.cuda.is_available() else paged.num_splits(1, 1, 32768, 32, torch.device("cpu"))
    assert many > 1
    assert paged.num_splits(batch=1, kv_heads=1, max_seq_len=100, max_splits=32, device=device) == 1
    assert paged.num_splits(batch=1, kv_heads=1, max_seq_len=10**6, max_splits=5, device=device) <= 5


# --------------------------------------------------------------------------------------------
# decode: the last split merges, by a ticket counter
# --------------------------------------------------------------------------------------------


@pytest.fixture
def many_splits(monkeypatch, short_splits):
    """As many splits as max_splits asks for, whatever the batch: the interpreter's few SMs would cap them."""
    monkeypatch.setattr(paged, "PROGRAMS_PER_SM", 10**4)


def _split_case(device, lengths=(300, 1, 0, 517, 64), heads=8, kv_heads=2, head_dim=32, block_size=16):
    k_cache, v_cache, block_tables, seq_lens = _paged_cache(list(lengths), kv_heads, head_dim, block_size,
                                                            torch.float32, device)
    q = _randn((len(lengths), heads, head_dim), torch.float32, device, 7)
    return q, k_cache, v_cache, block_tables, seq_lens


@pytest.mark.parametrize("max_splits", [2, 5, 13, 32])
def test_decode_merges_many_splits(device, many_splits, max_splits):
    q, k_cache, v_cache, block_tables, seq_lens = _split_case(device)
    max_seq_len = block_tables.shape[1] * 16
    assert paged.num_splits(q.shape[0], 2, max_seq_len, max_splits, q.device) == max_splits
    out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len=max_seq_len, max_splits=max_splits)
    expected = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens)
    assert_close(out, expected, torch.float32)
    assert not out[2].any()  # the empty context


@pytest.mark.parametrize("max_splits", [1, 6])
def test_decode_leaves_given_counters_at_zero_for_the_next_call(device, many_splits, max_splits):
    q, k_cache, v_cache, block_tables, seq_lens = _split_case(device)
    counters = torch.zeros(q.shape[0] * 2 + 3, dtype=torch.int32, device=device)  # more than needed is fine

    def call(counters):
        return decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_splits=max_splits, counters=counters)

    first = call(counters)
    assert not counters.any()
    assert torch.equal(call(counters), first)  # the buffer reused
    assert not counters.any()
    assert torch.equal(call(None), first)  # no buffer: the merge kernel launched apart, bitwise the same
    assert torch.equal(call(counters[: q.shape[0] * 2]), first)  # exactly as many as needed


def test_decode_split_merge_is_bitwise_repeatable(device, many_splits):
    q, k_cache, v_cache, block_tables, seq_lens = _split_case(device)
    runs = [decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_splits=9) for _ in range(3)]
    assert all(torch.equal(run, runs[0]) for run in runs)


def test_decode_bad_counters_raise_naming_them(device):
    q, k_cache, v_cache, block_tables, seq_lens = _split_case(device, lengths=(20, 5))
    need = q.shape[0] * 2

    def call(counters):
        decode_attention(q, k_cache, v_cache, block_tables, seq_lens, counters=counters)

    with pytest.raises(TypeError, match="counters must be a torch.Tensor"):
        call([0] * need)
    with pytest.raises(TypeError, match="counters must be int32"):
        call(torch.zeros(need, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="counters has 3 elements but this call needs at least 4"):
        call(torch.zeros(need - 1, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="counters must be contiguous"):
        call(torch.zeros(2 * need, dtype=torch.int32, device=device)[::2])
    elsewhere = "meta" if device.type == "cpu" else "cpu"
    with pytest.raises(ValueError, match="counters is on"):
        call(torch.zeros(need, dtype=torch.int32, device=elsewhere))


# --------------------------------------------------------------------------------------------
# decode: the dense layout's kernel (_dense_decode_kernel) against the general one
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths, heads, kv_heads, head_dim, block_size, splits", [
    ((1,), 1, 1, 16, 1, 1),
    ((0, 37, 5), 6, 2, 80, 16, 3),
    ((129, 1, 64, 300), 8, 1, 32, 64, 7),
    ((50, 17), 5, 5, 16, 4, 2),
])
def test_dense_kernel_is_bitwise_the_general_one(device, dtype, lengths, heads, kv_heads, head_dim, block_size,
                                                  splits):
    k_cache, v_cache, block_tables, seq_lens = _paged_cache(list(lengths), kv_heads, head_dim, block_size, dtype,
                                                            device)
    q = _randn((len(lengths), heads, head_dim), dtype, device, 7)
    assert paged._dense_inputs_ok(q, k_cache, v_cache, block_tables, seq_lens)
    counters = torch.zeros(len(lengths) * kv_heads, dtype=torch.int32, device=device)
    dense = paged.dense_decode_launch(q, k_cache, v_cache, block_tables, seq_lens, 0.3, splits, counters)
    for given in (counters, None):  # the general kernel, merging in its launch or in a second one
        general = paged.decode_launch(q, k_cache, v_cache, block_tables, seq_lens, 0.3, splits, given)
        assert dense.shape == general.shape and dense.stride() == general.stride()
        assert torch.equal(dense, general)
    assert not counters.any()


def test_decode_takes_the_dense_kernel_for_dense_inputs_only(device, many_splits, monkeypatch):
    calls = []
    dense_launch = paged.dense_decode_launch
    monkeypatch.setattr(paged, "dense_decode_launch", lambda *args: calls.append(args) or dense_launch(*args))
    q, k_cache, v_cache, block_tables, seq_lens = _split_case(device)
    counters = torch.zeros(q.shape[0] * 2, dtype=torch.int32, device=device)
    expected = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens)

    def check(q, k_cache, v_cache, block_tables, **kwargs):
        out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, **kwargs)
        assert_close(out, expected, torch.float32)

    check(q, k_cache, v_cache, block_tables, counters=counters)  # merged in the launch
    check(q, k_cache, v_cache, block_tables, max_splits=1)  # one split
    assert len(calls) == 2
    check(q, k_cache, v_cache, block_tables, max_splits=4)  # several splits and no tickets: a merge launch
    wide = torch.zeros(q.shape[0], q.shape[1] + 3, q.shape[2], device=device)
    wide[:, :q.shape[1]] = q
    check(wide[:, :q.shape[1]], k_cache, v_cache, block_tables, counters=counters)  # strided q
    padded = torch.zeros(*k_cache.shape[:3], 48, device=device)
    padded[..., :32] = k_cache
    check(q, padded[..., :32], v_cache, block_tables, counters=counters)  # strided cache
    tables = torch.zeros(block_tables.shape[0], 2 * block_tables.shape[1], dtype=torch.int32, device=device)
    tables[:, ::2] = block_tables
    check(q, k_cache, v_cache, tables[:, ::2], counters=counters)  # strided table
    assert len(calls) == 2


# --------------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------------


def test_store_kv_writes_slots_and_skips_padding(device):
    k_cache = torch.zeros(4, 16, 2, 16, device=device)
    v_cache = torch.zeros_like(k_cache)
    k, v = _randn((5, 2, 16), torch.float32, device, 0), _randn((5, 2, 16), torch.float32, device, 1)
    slots = torch.tensor([3, -1, 17, 63, 40], dtype=torch.int32, device=device)
    store_kv(k, v, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.store_kv(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert k_cache.count_nonzero() == 4 * 2 * 16  # the -1 token went nowhere


def test_store_kv_then_decode_sees_the_new_token(device):
    k_cache, v_cache, block_tables, _ = _paged_cache([32], 2, 16, 16, torch.float32, device)
    k_new, v_new = _randn((1, 2, 16), torch.float32, device, 3), _randn((1, 2, 16), torch.float32, device, 4)
    slot = block_tables[0, 1] * 16 + 3  # token 19
    store_kv(k_new, v_new, k_cache, v_cache, slot.view(1).to(torch.int32))
    assert torch.equal(k_cache[block_tables[0, 1], 3], k_new[0])
    q = _randn((1, 4, 16), torch.float32, device, 5)
    seq_lens = torch.tensor([20], dtype=torch.int32, device=device)
    expected = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens)
    assert_close(decode_attention(q, k_cache, v_cache, block_tables, seq_lens), expected, torch.float32)


def test_store_kv_reads_a_strided_slice_of_a_fused_projection(device):
    qkv = _randn((3, 4 * 16 + 2 * 2 * 16), torch.float32, device, 0)
    k = qkv[:, 64:96].view(3, 2, 16)
    v = qkv[:, 96:].view(3, 2, 16)
    k_cache = torch.zeros(2, 16, 2, 16, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 5, 31], dtype=torch.int32, device=device)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 16)[slots.long()], k)
    assert torch.equal(v_cache.view(-1, 2, 16)[slots.long()], v)


# --------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------


def test_bad_decode_inputs_raise_naming_the_argument(device):
    k_cache, v_cache, block_tables, seq_lens = _paged_cache([20, 5], 2, 16, 16, torch.float32, device)
    q = _randn((2, 4, 16), torch.float32, device, 7)
    with pytest.raises(ValueError, match="head dim 24"):
        decode_attention(torch.zeros(2, 4, 24, device=device), k_cache, v_cache, block_tables, seq_lens)
    with pytest.raises(TypeError, match="k_cache has dtype"):
        decode_attention(q.half(), k_cache, v_cache, block_tables, seq_lens)
    with pytest.raises(ValueError, match="whole multiple of k_cache's 2"):
        decode_attention(q[:, :3], k_cache, v_cache, block_tables, seq_lens)
    with pytest.raises(ValueError, match="v_cache has shape"):
        decode_attention(q, k_cache, v_cache[:, :8].contiguous(), block_tables, seq_lens)
    with pytest.raises(ValueError, match="block_size"):
        decode_attention(q, k_cache[:, :12], v_cache[:, :12].contiguous(), block_tables, seq_lens)
    with pytest.raises(TypeError, match="seq_lens must be int32"):
        decode_attention(q, k_cache, v_cache, block_tables, seq_lens.long())
    with pytest.raises(TypeError, match="block_tables must be int32"):
        decode_attention(q, k_cache, v_cache, block_tables.long(), seq_lens)
    with pytest.raises(ValueError, match="one entry per sequence"):
        decode_attention(q, k_cache, v_cache, block_tables[:1], seq_lens)
    with pytest.raises(ValueError, match="q must be"):
        decode_attention(q[0], k_cache, v_cache, block_tables, seq_lens)
    with pytest.raises(ValueError, match="max_splits"):
        decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_splits=0)
    elsewhere = q.to("meta") if device.type == "cpu" else q.cpu()
    with pytest.raises(ValueError, match=f"q must be a {device.type} tensor"):
        decode_attention(elsewhere, k_cache, v_cache, block_tables, seq_lens)


def test_bad_store_kv_inputs_raise_naming_the_argument(device):
    k_cache = torch.zeros(2, 16, 2, 16, device=device)
    k = torch.zeros(3, 2, 16, device=device)
    slots = torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k must be"):
        store_kv(torch.zeros(3, 4, 16, device=device), k, k_cache, k_cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries"):
        store_kv(k, k, k_cache, k_cache.clone(), slots[:2])
    with pytest.raises(TypeError, match="slot_mapping must be int32"):
        store_kv(k, k, k_cache, k_cache.clone(), slots.long())
    with pytest.raises(ValueError, match="k_cache must hold each slot's heads side by side"):
        store_kv(k, k, torch.zeros(2, 16, 2, 32, device=device)[..., :16], k_cache.clone(), slots)


# --------------------------------------------------------------------------------------------
# GPU, at real sizes
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_decode_at_real_size(head_dim):
    lengths = torch.randint(1, 4096, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    lengths[0] = 4096
    _check_decode("cuda", lengths, heads=32, kv_heads=8, head_dim=head_dim, block_size=16, dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_decode_in_a_cuda_graph_replayed_with_new_lengths():
    lengths = [4096, 100, 1, 2000, 3000, 17, 4095, 512]
    k_cache, v_cache, block_tables, seq_lens = _paged_cache(lengths, 8, 128, 16, torch.bfloat16, "cuda")
    q = _randn((8, 32, 128), torch.bfloat16, "cuda", 7)
    max_seq_len = block_tables.shape[1] * 16
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len=max_seq_len)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, max_seq_len=max_seq_len)
    for new_lengths in ([1, 2, 3, 4, 5, 6, 7, 8], [4096] * 8, [0, 4000, 33, 1024, 2048, 16, 15, 4096]):
        seq_lens.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        q.copy_(_randn(q.shape, torch.bfloat16, "cuda", sum(new_lengths)))
        graph.replay()
        expected = reference.decode_attention(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens)
        assert_close(out, expected, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_store_kv_in_a_cuda_graph_with_padding_slots():
    k_cache = torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(2, 32, 8, 128, device="cuda", dtype=torch.bfloat16).unbind(0)
    slots = torch.full((32,), -1, dtype=torch.int32, device="cuda")
    store_kv(k, v, k_cache, v_cache, slots)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(k, v, k_cache, v_cache, slots)
    slots[:20] = torch.randperm(64 * 16, device="cuda")[:20].int()
    graph.replay()
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.store_kv(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
