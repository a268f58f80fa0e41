import pytest
import torch

from fuselab.engine import LLM
from fuselab.engine.weight_prefetch import POINTS, WeightPrefetch, plan_prefetches


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.fixture(scope="module")
def layers():
    return LLM("tiny", mode="fused", max_model_len=64).model.model.layers


def test_the_plan_walks_each_weight_from_its_first_byte_within_the_budgets(layers):
    o = layers[0].self_attn.o_proj.weight
    gate_up = layers[0].mlp.gate_up_proj.weight
    budgets = (nbytes(o) + 1024, 2048, 512, 256)
    plans = plan_prefetches(layers, budgets)
    assert len(plans) == len(layers) and all(len(p) == POINTS for p in plans)
    first = plans[0]
    # After q/k/v: all of the output projection, then gate/up's first bytes; after the output projection, on from there.
    assert [(t is o, t is gate_up, s, n) for t, s, n in first[0]] == [(True, False, 0, nbytes(o)), (False, True, 0, 1024)]
    assert [(t is gate_up, s, n) for t, s, n in first[1]] == [(True, 1024, 2048)]
    assert [(t is layers[0].mlp.down_proj.weight, s, n) for t, s, n in first[2]] == [(True, 0, 512)]
    assert [(t is layers[1].self_attn.qkv_proj.weight, s, n) for t, s, n in first[3]] == [(True, 0, 256)]
    assert plans[-1][3] == []  # the last layer's next projection is lm_head's, not prefetched
    for plan in plans:
        for point, ranges in enumerate(plan):
            assert sum(n for _, _, n in ranges) <= budgets[point]
            assert all(0 <= s and s + n <= nbytes(t) for t, s, n in ranges)


def test_a_budget_past_a_weight_stops_at_its_end(layers):
    huge = 1 << 40
    plan = plan_prefetches(layers, (huge, huge, huge, 0))[0]
    assert sum(n for _, _, n in plan[0]) == nbytes(layers[0].self_attn.o_proj.weight) + nbytes(
        layers[0].mlp.gate_up_proj.weight)
    assert plan[1] == [] and plan[3] == []
    assert plan[2][0][2] == nbytes(layers[0].mlp.down_proj.weight)


def test_quantized_layers_prefetch_their_codes():
    layers = LLM("tiny", mode="fused", quantization="int4", max_model_len=64).model.model.layers
    (t, start, n), = plan_prefetches(layers, (256, 0, 0, 0))[0][0]
    assert t is layers[0].self_attn.o_proj.weight.data and t.dtype == torch.int32 and (start, n) == (0, 256)


@pytest.mark.parametrize("budgets", [(1, 2, 3), (1, 2, 3, -4)])
def test_bad_budgets_are_named(layers, budgets):
    with pytest.raises(ValueError, match="budgets must be 4 byte counts >= 0"):
        WeightPrefetch(layers, budgets, torch.device("cpu"))
