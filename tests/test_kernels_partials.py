"""The sum of a backward's per-program partials (dweight, dbias), and the single-program shortcut."""

import pytest
import torch
from kernel_checks import DTYPES, assert_close, kernel_module, leaf

from fuselab.kernels import bias_act, layer_norm, reference, rms_norm
from fuselab.kernels._common.partials import new_partials, sum_partials


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups, n_partials, n_cols", [(1, 1, 5), (1, 2, 1), (2, 33, 70), (1, 97, 129), (2, 65, 3)])
def test_sum_partials_adds_each_groups_rows_in_fp32(device, dtype, groups, n_partials, n_cols):
    partials = torch.randn(groups, n_partials, n_cols, generator=torch.Generator().manual_seed(0)).to(device)
    out = sum_partials(partials, dtype)
    assert out.dtype == dtype and out.shape == (groups, n_cols)
    assert_close(out, partials.double().sum(dim=1), dtype, scale=4)


def test_sum_partials_of_an_empty_width_is_empty(device):
    assert sum_partials(torch.empty(2, 3, 0, device=device), torch.bfloat16).shape == (2, 0)


def test_one_row_of_partials_is_allocated_in_the_final_dtype_and_returned_as_is(device):
    partials = new_partials(2, 1, 7, torch.bfloat16, device, accumulated=False)
    assert partials.dtype == torch.bfloat16
    sums = sum_partials(partials, torch.bfloat16)
    assert sums.data_ptr() == partials.data_ptr()
    # Several rows, or a looped kernel that adds into the buffer: fp32, and zeroed for the latter.
    assert new_partials(1, 2, 7, torch.bfloat16, device, accumulated=False).dtype == torch.float32
    accumulated = new_partials(1, 1, 7, torch.bfloat16, device, accumulated=True)
    assert accumulated.dtype == torch.float32 and not accumulated.any()


def _no_sum_kernel(monkeypatch, module_name):
    """Fail if the op's backward launches the partials' sum."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a single program's sums need no second kernel")

    monkeypatch.setattr(kernel_module(module_name), "sum_partials", lambda p, d: forbidden() if p.shape[1] > 1 else p[:, 0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "bias_act"])
def test_one_row_backward_writes_the_parameter_gradients_directly(device, monkeypatch, dtype, op):
    """At one row the backward has one program (one band): its sums are the totals, in the parameter's dtype."""
    _no_sum_kernel(monkeypatch, op)
    g = torch.Generator().manual_seed(1)
    x, w, b, dy = (torch.randn(shape, generator=g).to(dtype).to(device) for shape in [(1, 300), (300,), (300,), (1, 300)])
    if op == "rms_norm":
        params, ours, ref = (w,), lambda x, w: rms_norm(x, w), lambda x, w: reference.rms_norm(x, w)
    elif op == "layer_norm":
        params, ours, ref = (w, b), lambda x, w, b: layer_norm(x, w, b), lambda x, w, b: reference.layer_norm(x, w, b)
    else:
        params, ours, ref = (b,), lambda x, b: bias_act(x, b, "gelu"), lambda x, b: reference.bias_act(x, b, "gelu")
    leaves = [t.clone().requires_grad_(True) for t in (x, *params)]
    ours(*leaves).backward(dy)
    ref_leaves = [leaf(t) for t in (x, *params)]
    ref(*ref_leaves).backward(dy.double())
    for got, want in zip(leaves[1:], ref_leaves[1:]):
        assert got.grad.dtype == dtype
        assert_close(got.grad, want.grad, dtype, scale=2)


def test_layer_norm_with_weight_and_bias_of_different_dtypes_gets_each_gradient_in_its_own(device):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 96, generator=g).to(device)
    w = torch.randn(96, generator=g).to(device).requires_grad_(True)
    b = torch.randn(96, generator=g).to(torch.bfloat16).to(device).requires_grad_(True)
    layer_norm(x, w, b).sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.bfloat16
    assert_close(b.grad, torch.full((96,), 40.0, dtype=torch.float64, device=device), torch.bfloat16)
