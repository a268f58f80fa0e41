"""Sampler: greedy, temperature, top-k, top-p, and seeded draws that do not depend on the batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fuselab.engine.sampler import Sampler, SamplingBatch, gumbel_noise, hash32, top_k_top_p_mask
from fuselab.engine.sampling_params import SamplingParams
from fuselab.engine.sequence import Sequence


def _batch(params, seeds, steps=None):
    seqs = [Sequence(i, [1], p, seed) for i, (p, seed) in enumerate(zip(params, seeds))]
    for seq, step in zip(seqs, steps or [0] * len(seqs)):
        seq.token_ids += [0] * step
    return SamplingBatch.from_sequences(seqs, torch.device("cpu"))


def test_hash32_matches_the_reference_integer_hash():
    def lowbias32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 12345, 2**31, 2**32 - 1]
    assert hash32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]


def test_gumbel_noise_is_finite_and_gumbel_distributed():
    g = gumbel_noise(torch.tensor([7]), torch.tensor([0]), torch.arange(200_000)[None])
    assert torch.isfinite(g).all()
    # Gumbel(0, 1): mean = Euler-Mascheroni constant, variance = pi^2 / 6.
    assert g.mean().item() == pytest.approx(0.5772, abs=0.01)
    assert g.var().item() == pytest.approx(torch.pi**2 / 6, abs=0.03)


def test_top_k_mask_keeps_the_k_best():
    sorted_logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    keep = top_k_top_p_mask(sorted_logits, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert keep.tolist() == [[True, True, False, False], [True, True, True, True]]


def test_top_p_mask_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    for top_p, kept in ((0.5, 1), (0.6, 2), (0.8, 2), (0.81, 3), (0.99, 4), (0.01, 1)):
        keep = top_k_top_p_mask(logits, torch.tensor([0]), torch.tensor([top_p]))
        assert keep.sum().item() == kept, top_p


def test_top_p_applies_to_the_top_k_renormalized():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # Of the top 2, renormalized to 0.625 / 0.375, p = 0.6 keeps only the first.
    keep = top_k_top_p_mask(logits, torch.tensor([2]), torch.tensor([0.6]))
    assert keep.tolist() == [[True, False, False, False]]


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 50)
    batch = _batch([SamplingParams(temperature=0)] * 3, [1, 2, 3])
    assert Sampler()(logits, batch).tolist() == logits.argmax(-1).tolist()


def test_sampled_tokens_follow_top_k():
    logits = torch.randn(1, 100).repeat(400, 1)
    params = [SamplingParams(temperature=5.0, top_k=3)] * 400
    tokens = Sampler()(logits, _batch(params, list(range(400))))
    assert set(tokens.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_sampled_frequencies_follow_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 4000
    logits = (probs.log() * 2.0).repeat(n, 1)  # with temperature 2, softmax(logits / 2) = probs
    tokens = Sampler()(logits, _batch([SamplingParams(temperature=2.0)] * n, list(range(n))))
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_a_seed_draws_the_same_tokens_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    logits[3] = logits[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
    mixed = [seeded, SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5), seeded]
    together = Sampler()(logits, _batch(mixed, [11, 0, 99, 11], steps=[3, 0, 0, 3]))
    alone = Sampler()(logits[:1], _batch([seeded], [11], steps=[3]))
    assert together[0] == alone[0] == together[3]
    other_step = Sampler()(logits[:1].repeat(64, 1), _batch([seeded] * 64, [11] * 64, steps=list(range(64))))
    assert len(set(other_step.tolist())) > 1  # each output step draws fresh noise


def test_rows_without_top_k_or_top_p_skip_the_sort_and_draw_the_same_tokens():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000)
    params = [SamplingParams(temperature=t) for t in (0.5, 1.0, 2.0, 0)] * 16
    batch = _batch(params, list(range(64)), steps=list(range(64)))
    assert not batch.any_filter
    unsorted = Sampler()(logits, batch)
    # The same rows through the sorted path (as in a batch where another row has a filter).
    sorted_path = Sampler()(logits, dataclasses.replace(batch, any_filter=True))
    assert unsorted.tolist() == sorted_path.tolist()
    assert len(set(unsorted.tolist())) > 30  # sampled, not greedy
    assert _batch([SamplingParams(temperature=1.0, top_p=0.5)], [0]).any_filter
    assert not _batch([SamplingParams(temperature=0, top_k=5)], [0]).any_filter  # greedy rows filter nothing


def test_top_k_one_is_greedy():
    logits = torch.randn(8, 30)
    batch = _batch([SamplingParams(temperature=1.5, top_k=1)] * 8, list(range(8)))
    assert Sampler()(logits, batch).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(seed=-3), "seed"),
    (dict(seed="7"), "seed"),
])
def test_bad_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_ignore_eos_must_be_a_bool():
    with pytest.raises(TypeError, match="ignore_eos"):
        SamplingParams(ignore_eos="yes")
