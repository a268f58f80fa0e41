"""The folded one-row GEMVs (fuselab.kernels.folded_linear) against float64 references and against the
unfused fuselab chain they replace, and the engine's decode steps with and without them."""

import os
import random
import runpy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPES, assert_close, kernel_module

from fuselab.engine import LLM, SamplingParams
from fuselab.kernels import linear, rms_norm, silu_and_mul
from fuselab.kernels.folded_linear import add_rms_norm_linear, silu_mul_linear

folded = kernel_module("folded_linear")
EPS = 1e-5


def _randn(shape, dtype, device, seed, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(device)


def _norm_inputs(k, n, dtype, device, seed=0):
    """x, residual, norm weight (around 1) and W [n, k] scaled so that y stays of order 1."""
    return (_randn((1, k), dtype, device, seed), _randn((1, k), dtype, device, seed + 1),
            _randn((k,), dtype, device, seed + 2, 0.2) + 1, _randn((n, k), dtype, device, seed + 3, k**-0.5))


def _count(monkeypatch, name):
    """Calls of folded_linear.`name` (a launcher), which still runs."""
    original, calls = getattr(folded, name), []
    monkeypatch.setattr(folded, name, lambda *a: calls.append(a) or original(*a))
    return calls


def _norm_reference(x, residual, norm_weight, weight, bias=None):
    """float64: (normalized h projected, h), h rounded to x's dtype as the unfused add leaves it."""
    h = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    hd = h.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()
    return F.linear(normed, weight.double(), None if bias is None else bias.double()), h


# --------------------------------------------------------------------------------------------
# add_rms_norm_linear
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 3, 257, 2048, 3001, 4096])
def test_norm_fold_is_one_kernel_that_equals_the_unfused_chain(device, dtype, k, monkeypatch):
    calls = _count(monkeypatch, "add_rms_norm_gemv_launch")
    x, residual, norm_weight, weight = _norm_inputs(k, 37, dtype, device, seed=k)
    y, h = add_rms_norm_linear(x, residual, norm_weight, EPS, weight)
    assert len(calls) == 1 and y.shape == (1, 37) and y.dtype == dtype and h.shape == x.shape
    normed, h_unfused = rms_norm(x, norm_weight, EPS, residual)
    expected = linear(normed, weight)
    assert torch.equal(h, h_unfused)
    if device.type == "cpu":  # the interpreter sums in the same order as the unfused kernels
        assert torch.equal(y, expected)
    else:  # compiled, the mean square's sum may take another order: an ulp of fp32 in rstd
        assert_close(y, expected.double(), dtype, scale=2.0)
    y_ref, h_ref = _norm_reference(x, residual, norm_weight, weight)
    assert_close(h, h_ref, dtype)  # the interpreter rounds fp32 to bf16 toward zero: an ulp apart
    # The normalized row is rounded to the dtype before the product, as the unfused chain stores it.
    assert_close(y, y_ref, dtype, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_fold_without_residual_and_with_bias(device, dtype, monkeypatch):
    calls = _count(monkeypatch, "add_rms_norm_gemv_launch")
    x, _, norm_weight, weight = _norm_inputs(300, 50, dtype, device, seed=4)
    bias = _randn((50,), dtype, device, 9)
    y, h = add_rms_norm_linear(x, None, norm_weight, EPS, weight, bias)
    assert len(calls) == 1 and h is x
    expected = linear(rms_norm(x, norm_weight, EPS), weight, bias)
    if device.type == "cpu":
        assert torch.equal(y, expected)
    assert_close(y, _norm_reference(x, None, norm_weight, weight, bias)[0], dtype, scale=4.0)


def test_norm_fold_leading_dims_and_strided_inputs(device, monkeypatch):
    calls = _count(monkeypatch, "add_rms_norm_gemv_launch")
    x = _randn((1, 1, 600), torch.float32, device, 1)[..., ::2]  # stride 2 along K
    residual = _randn((1, 1, 300), torch.float32, device, 2)
    norm_weight = _randn((600,), torch.float32, device, 3)[::2] + 1
    weight = _randn((20, 300), torch.float32, device, 4, 0.05)
    y, h = add_rms_norm_linear(x, residual, norm_weight, EPS, weight)
    assert len(calls) == 1 and y.shape == (1, 1, 20) and h.shape == (1, 1, 300)
    y_ref, h_ref = _norm_reference(x, residual, norm_weight, weight)
    assert torch.equal(h, h_ref)
    assert_close(y, y_ref, torch.float32, scale=4.0)


@pytest.mark.parametrize("case", ["rows", "long row", "column-major weight", "grad"])
def test_norm_fold_runs_the_unfused_chain_where_the_gemv_would_not_run(device, case, monkeypatch):
    monkeypatch.setattr(folded, "add_rms_norm_gemv_launch", lambda *a: pytest.fail("the fold ran"))
    rows, k = (3, 64) if case == "rows" else (1, 4097 if case == "long row" else 64)
    x, residual = _randn((rows, k), torch.float32, device, 1), _randn((rows, k), torch.float32, device, 2)
    norm_weight, weight = _randn((k,), torch.float32, device, 3) + 1, _randn((16, k), torch.float32, device, 4, 0.1)
    if case == "column-major weight":
        weight = weight.t().contiguous().t()
    if case == "grad":
        x.requires_grad_(True)
    y, h = add_rms_norm_linear(x, residual, norm_weight, EPS, weight)
    y_ref, h_ref = _norm_reference(x.detach(), residual, norm_weight, weight)
    assert_close(y.detach(), y_ref, torch.float32, scale=4.0)
    assert torch.equal(h.detach(), h_ref)
    if case == "grad":
        y.sum().backward()
        assert x.grad is not None and x.grad.isfinite().all()


def test_norm_fold_nan_propagates(device):
    x, residual, norm_weight, weight = _norm_inputs(64, 8, torch.float32, device)
    x[0, 5] = float("nan")
    y, h = add_rms_norm_linear(x, residual, norm_weight, EPS, weight)
    assert y.isnan().all() and h[0, 5].isnan() and not h[0, 4].isnan()


def test_norm_fold_bad_inputs(device):
    x, residual, norm_weight, weight = _norm_inputs(8, 4, torch.float32, device)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        add_rms_norm_linear([0.0] * 8, residual, norm_weight, EPS, weight)
    with pytest.raises(ValueError, match="x's last dim \\(8\\) must equal weight's in_features \\(9\\)"):
        add_rms_norm_linear(x, residual, norm_weight, EPS, torch.zeros(4, 9, device=device))
    with pytest.raises(TypeError, match="weight has dtype"):
        add_rms_norm_linear(x, residual, norm_weight, EPS, weight.half())
    with pytest.raises(ValueError, match="residual has shape"):
        add_rms_norm_linear(x, residual[:, :4], norm_weight, EPS, weight)
    with pytest.raises(TypeError, match="residual has dtype"):
        add_rms_norm_linear(x, residual.half(), norm_weight, EPS, weight)
    with pytest.raises(ValueError, match="norm_weight must have shape \\(8,\\)"):
        add_rms_norm_linear(x, residual, norm_weight[:4], EPS, weight)
    with pytest.raises(TypeError, match="norm_weight must be float32"):
        add_rms_norm_linear(x, residual, norm_weight.long(), EPS, weight)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        add_rms_norm_linear(x, residual, norm_weight, -1.0, weight)
    with pytest.raises(ValueError, match="bias must have shape \\(4,\\)"):
        add_rms_norm_linear(x, residual, norm_weight, EPS, weight, torch.zeros(5, device=device))


# --------------------------------------------------------------------------------------------
# silu_mul_linear
# --------------------------------------------------------------------------------------------


def _silu_reference(gate_up, weight):
    gate, up = gate_up.double().chunk(2, dim=-1)
    swiglu = (F.silu(gate) * up).to(gate_up.dtype)  # rounded as silu_and_mul stores it
    return F.linear(swiglu.double(), weight.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 3, 1000, 2048, 4096, 5003, 8192])
def test_silu_fold_is_one_kernel_that_equals_the_unfused_chain(device, dtype, k, monkeypatch):
    calls = _count(monkeypatch, "silu_mul_gemv_launch")
    gate_up = _randn((1, 2 * k), dtype, device, k)
    weight = _randn((29, k), dtype, device, k + 1, k**-0.5)
    y = silu_mul_linear(gate_up, weight)
    assert len(calls) == 1 and y.shape == (1, 29) and y.dtype == dtype
    # Elementwise SwiGLU, then the GEMV's own blocks and sums: the same rounding, compiled or not.
    assert torch.equal(y, linear(silu_and_mul(gate_up), weight))
    assert_close(y, _silu_reference(gate_up, weight), dtype, scale=4.0)


@pytest.mark.parametrize("case", ["rows", "column-major weight", "grad"])
def test_silu_fold_runs_the_unfused_chain_where_the_gemv_would_not_run(device, case, monkeypatch):
    monkeypatch.setattr(folded, "silu_mul_gemv_launch", lambda *a: pytest.fail("the fold ran"))
    gate_up = _randn((3 if case == "rows" else 1, 2 * 40), torch.float32, device, 1)
    weight = _randn((16, 40), torch.float32, device, 2, 0.1)
    if case == "column-major weight":
        weight = weight.t().contiguous().t()
    if case == "grad":
        gate_up.requires_grad_(True)
    y = silu_mul_linear(gate_up, weight)
    assert_close(y.detach(), _silu_reference(gate_up.detach(), weight), torch.float32, scale=4.0)
    if case == "grad":
        y.sum().backward()
        assert gate_up.grad is not None and gate_up.grad.shape == gate_up.shape


def test_silu_fold_nan_propagates(device):
    gate_up = _randn((1, 128), torch.float32, device, 1)
    gate_up[0, 70] = float("nan")  # in the up half
    assert silu_mul_linear(gate_up, _randn((8, 64), torch.float32, device, 2)).isnan().all()


def test_silu_fold_bad_inputs(device):
    gate_up, weight = torch.zeros(1, 16, device=device), torch.zeros(4, 8, device=device)
    with pytest.raises(TypeError, match="gate_up must be a torch.Tensor"):
        silu_mul_linear([0.0] * 16, weight)
    with pytest.raises(ValueError, match="gate_up must have at least one dimension"):
        silu_mul_linear(torch.zeros((), device=device), weight)
    with pytest.raises(TypeError, match="weight must be float32"):
        silu_mul_linear(gate_up, weight.long())
    with pytest.raises(ValueError, match="weight must be 2-D"):
        silu_mul_linear(gate_up, torch.zeros(8, device=device))
    with pytest.raises(ValueError, match="gate_up's last dim \\(15\\) must hold \\[gate \\| up\\], twice weight's"):
        silu_mul_linear(torch.zeros(1, 15, device=device), weight)
    with pytest.raises(TypeError, match="gate_up has dtype"):
        silu_mul_linear(gate_up.half(), weight)


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory):
    from engine_checkpoints import build_hf_model, save_checkpoint

    model = build_hf_model("llama3")
    return model, save_checkpoint(model, tmp_path_factory.mktemp("checkpoint") / "llama3")


def _fold_calls(monkeypatch):
    return _count(monkeypatch, "add_rms_norm_gemv_launch"), _count(monkeypatch, "silu_mul_gemv_launch")


@pytest.mark.filterwarnings("ignore:mode 'fused' on the CPU")
def test_engine_decode_at_one_row_folds_and_matches_transformers(llama3_checkpoint, monkeypatch):
    from engine_checkpoints import hf_greedy

    hf_model, path = llama3_checkpoint
    prompt = [random.Random(3).randrange(256) for _ in range(9)]
    expected = hf_greedy(hf_model, prompt, 4)
    folds, silu_folds = _fold_calls(monkeypatch)
    llm = LLM(path, mode="fused", dtype="float32", max_model_len=64, max_num_seqs=1)
    assert [layer.fold for layer in llm.model.model.layers] == [True, True]
    (folded_out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))
    assert folded_out.token_ids == expected
    # 3 decode steps of 2 layers each; the prefill ran the unfused ops.
    assert len(folds) == len(silu_folds) == 6


@pytest.mark.filterwarnings("ignore:mode 'fused' on the CPU")
def test_fold_off_by_environment_and_several_rows_run_the_unfused_ops(llama3_checkpoint, monkeypatch):
    from engine_checkpoints import hf_greedy

    hf_model, path = llama3_checkpoint
    monkeypatch.setenv("FUSELAB_FOLD", "0")
    llm = LLM(path, mode="fused", dtype="float32", max_model_len=64, max_num_seqs=1)
    assert not any(layer.fold for layer in llm.model.model.layers)
    monkeypatch.delenv("FUSELAB_FOLD")
    folds, silu_folds = _fold_calls(monkeypatch)
    prompts = [[random.Random(s).randrange(256) for _ in range(n)] for s, n in ((1, 5), (2, 11))]
    llm = LLM(path, mode="fused", dtype="float32", max_model_len=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3))
    assert [o.token_ids for o in outputs] == [hf_greedy(hf_model, p, 3) for p in prompts]
    assert folds == [] and silu_folds == []  # every decode step had two rows


def test_the_fold_is_for_fused_float_models_only():
    from fuselab.engine.config import ModelConfig
    from fuselab.engine.model import build_model
    from fuselab.engine.quantize import parse_quantization

    config = ModelConfig.preset("tiny")
    cpu = torch.device("cpu")

    def folds(mode, quant=None, fold=None):
        model = build_model(config, torch.float32, cpu, 64, mode, quant, fold=fold)
        return {layer.fold for layer in model.model.layers}

    assert folds("fused") == {True} and folds("fused", fold=False) == {False}
    assert folds("eager") == {False} and folds("eager", fold=True) == {False}
    assert folds("fused", parse_quantization("int8")) == {False}


# --------------------------------------------------------------------------------------------
# scripts/tune-fold
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour of a GPU script")
def test_tune_fold_says_it_needs_a_gpu(monkeypatch, capsys):
    script = Path(__file__).resolve().parent.parent / "scripts" / "tune-fold"
    monkeypatch.setattr(sys, "argv", [str(script)])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(script), run_name="__main__")
    assert exit.value.code == 1 and "needs a CUDA GPU" in capsys.readouterr().out
    assert os.environ.get("FUSELAB_FOLD") is None  # the script leaves the process's setting as it found it
