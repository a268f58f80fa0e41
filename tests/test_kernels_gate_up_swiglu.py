import pytest
import torch
from kernel_checks import DTYPES, assert_close, kernel_module

from fuselab.engine.model import in_major_linear
from fuselab.kernels import gate_up_swiglu, linear, reference, silu_and_mul

fused = kernel_module("gate_up_swiglu")


def _randn(shape, dtype, device, seed=0, scale=1.0):
    return (scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype).to(device)


def _in_major(k, i, dtype, device, seed=1):
    """The [2I, K] weight as the engine stores it: the .t() view of a row-major [K, 2I] matrix."""
    return _randn((k, 2 * i), dtype, device, seed, scale=max(k, 1) ** -0.5).t()


def _check(x, weight, got=None):
    got = gate_up_swiglu(x, weight) if got is None else got
    expected = reference.gate_up_swiglu(x.double(), weight.double())
    assert got.shape == expected.shape and got.dtype == x.dtype and got.device == x.device
    # A dot product over K rounds like K sums (fp32 in another order), and half precision rounds
    # gate and up before the activation and its result after.
    assert_close(got, expected, x.dtype, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 17, 100, 2048])
@pytest.mark.parametrize("i", [1, 3, 96, 1000])
def test_matches_the_reference(device, dtype, k, i):
    _check(_randn((1, k), dtype, device, seed=k), _in_major(k, i, dtype, device, seed=i))


def test_leading_dims_and_a_strided_row(device):
    weight = _in_major(40, 24, torch.float32, device)
    _check(_randn((1, 1, 40), torch.float32, device), weight)
    x = _randn((80,), torch.float32, device)[::2]  # stride 2 along K
    _check(x, weight)
    assert gate_up_swiglu(x, weight).shape == (24,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_engines_layout_matches_linear_and_silu_and_mul(device, dtype):
    layer = in_major_linear(300, 2 * 130, dtype).to(device)
    with torch.no_grad():
        layer.weight.copy_(_randn((260, 300), dtype, device, 2, scale=300**-0.5))
    x = _randn((1, 300), dtype, device, 3)
    with torch.inference_mode():  # the parameter requires grad, as the engine's does
        got = gate_up_swiglu(x, layer.weight)
        two_launches = silu_and_mul(linear(x, layer.weight))
    _check(x, layer.weight, got)
    assert_close(got, two_launches.double(), dtype, scale=4.0)


def test_a_row_pitch_wider_than_the_weight(device):
    # The gate/up columns of a wider in-major matrix: rows 2I + 6 elements apart.
    wide = _randn((50, 2 * 20 + 6), torch.float32, device, 4, scale=50**-0.5)
    _check(_randn((1, 50), torch.float32, device, 5), wide[:, :40].t())


def test_the_config_rule_fills_the_sms():
    # Llama 3 8B and 1B on an H200's 132 SMs: 128-column tiles, split until 2 programs an SM (at most 4).
    assert fused.gate_up_config(4096, 14336, 132) == (128, 32, 4, 4)
    assert fused.gate_up_config(2048, 8192, 132) == (128, 32, 4, 4)
    for k, i in ((4096, 14336), (2048, 8192)):
        block_n, _, split_k, _ = fused.gate_up_config(k, i, 132)
        assert -(-i // block_n) * split_k >= 132
    # Small shapes: blocks shrink to the (power-of-two) shape, no more splits than steps of K.
    assert fused.gate_up_config(17, 3, 132) == (4, 32, 1, 4)
    assert fused.gate_up_config(100, 96, 132) == (128, 32, 4, 4)
    assert fused.gate_up_config(4096, 1 << 20, 132) == (128, 32, 1, 4)
    # Without split-K: one program a tile of 64 columns, 8 warps.
    assert fused.gate_up_config(2048, 8192, 132, max_split_k=1) == (64, 64, 1, 8)
    assert fused.gate_up_config(17, 3, 132, max_split_k=1) == (4, 32, 1, 8)


def test_max_split_k_one_gives_the_same_result(device):
    x, weight = _randn((1, 300), torch.float32, device), _in_major(300, 70, torch.float32, device)
    torch.testing.assert_close(fused.gate_up_swiglu(x, weight, max_split_k=1), fused.gate_up_swiglu(x, weight),
                               rtol=1e-5, atol=1e-5)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_split_k"):
            fused.gate_up_swiglu(x, weight, max_split_k=bad)


@pytest.mark.parametrize("config", [(16, 16, 1, 2), (16, 8, 3, 4), (32, 16, 7, 1), (8, 64, 2, 4)])
def test_the_config_override(device, config):
    # (16, 8, 3, ...): uneven runs of steps; (32, 16, 7, ...) on K=100 (7 steps): a step a split;
    # (8, 64, 2, ...): K=100 in two steps, one masked in part.
    x, weight = _randn((1, 100), torch.float32, device), _in_major(100, 50, torch.float32, device)
    _check(x, weight, fused.gate_up_swiglu_launch(x, weight, config))


def test_more_splits_than_steps_store_zero_partials(device):
    x, weight = _randn((1, 20), torch.float32, device), _in_major(20, 9, torch.float32, device)
    _check(x, weight, fused.gate_up_swiglu_launch(x, weight, (8, 16, 4, 4)))  # 2 steps, 4 splits


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_is_deterministic_and_leaves_the_counters_at_zero(device, dtype):
    x, weight = _randn((1, 1000), dtype, device), _in_major(1000, 40, dtype, device)
    config = (16, 32, 8, 4)
    counters = torch.zeros(3, dtype=torch.int32, device=device)
    first = fused.gate_up_swiglu_launch(x, weight, config, counters)
    assert counters.tolist() == [0, 0, 0]
    for _ in range(3):
        assert torch.equal(fused.gate_up_swiglu_launch(x, weight, config, counters), first)
    assert torch.equal(fused.gate_up_swiglu_launch(x, weight, config), first)  # fresh counters
    _check(x, weight, first)


@pytest.mark.parametrize("config", [(16, 16, 1), (16, 16, 1, 2.0), (24, 16, 1, 4), (16, 16, 0, 4), (16, 16, 1, 3)])
def test_a_bad_config_is_named(device, config):
    x, weight = _randn((1, 8), torch.float32, device), _in_major(8, 4, torch.float32, device)
    with pytest.raises(ValueError, match="config"):
        fused.gate_up_swiglu_launch(x, weight, config)


def test_nan_reaches_only_its_columns(device):
    x, weight = _randn((1, 64), torch.float32, device), _in_major(64, 100, torch.float32, device).clone()
    weight[5, 3] = float("nan")  # a gate column
    weight[100 + 7, 60] = float("nan")  # an up column
    y = gate_up_swiglu(x, weight)
    assert y[0].isnan().nonzero().flatten().tolist() == [5, 7]


def test_empty_shapes(device):
    assert gate_up_swiglu(torch.zeros(1, 8, device=device), _in_major(8, 0, torch.float32, device)).shape == (1, 0)
    y = gate_up_swiglu(torch.zeros(1, 0, device=device), _in_major(0, 5, torch.float32, device))
    assert y.tolist() == [[0.0] * 5]


def test_bad_inputs_name_the_argument(device):
    x, weight = torch.zeros(1, 8, device=device), _in_major(8, 4, torch.float32, device)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        gate_up_swiglu([0.0] * 8, weight)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        gate_up_swiglu(x, None)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        gate_up_swiglu(x.long(), weight)
    with pytest.raises(TypeError, match="weight must be float32, bfloat16 or float16"):
        gate_up_swiglu(x, weight.double())
    with pytest.raises(ValueError, match="weight must be a cpu tensor|weight must be a cuda tensor"):
        gate_up_swiglu(x, weight.to("meta"))
    with pytest.raises(TypeError, match="x has dtype torch.float16 but weight has dtype torch.float32"):
        gate_up_swiglu(x.half(), weight)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        gate_up_swiglu(x, weight[0])
    with pytest.raises(ValueError, match="weight's first dim holds \\[gate \\| up\\] and must be even, got 7"):
        gate_up_swiglu(x, weight[:7])
    with pytest.raises(ValueError, match="x's last dim \\(8\\) must equal weight's in_features \\(5\\)"):
        gate_up_swiglu(x, _in_major(5, 4, torch.float32, device))
    with pytest.raises(ValueError, match="x must have at least one dimension"):
        gate_up_swiglu(torch.tensor(1.0, device=device), weight)
    with pytest.raises(ValueError, match="x must hold one row.*use linear and silu_and_mul"):
        gate_up_swiglu(torch.zeros(2, 8, device=device), weight)
    with pytest.raises(ValueError, match="weight must be stored in-major.*strides \\(8, 1\\)"):
        gate_up_swiglu(x, weight.contiguous())


def test_inputs_that_require_grad_are_refused(device):
    x, weight = _randn((1, 8), torch.float32, device), _in_major(8, 4, torch.float32, device)
    with pytest.raises(RuntimeError, match="not differentiable"):
        gate_up_swiglu(x.requires_grad_(True), weight)
    with pytest.raises(RuntimeError, match="not differentiable"):
        gate_up_swiglu(x.detach(), torch.nn.Parameter(weight))
    with torch.no_grad():
        _check(x.detach(), weight, gate_up_swiglu(x, torch.nn.Parameter(weight)))


@pytest.mark.gpu
@pytest.mark.parametrize("k, i", [(2048, 8192), (4096, 14336)])
def test_gpu_llama_shapes(k, i):
    _check(_randn((1, k), torch.bfloat16, "cuda", 1), _in_major(k, i, torch.bfloat16, "cuda", 2))
