"""fast_launch: the specialization key holds what Triton 3.6 compiles a kernel for, the bound C launcher
gets what JITFunction.run would pass it, and anything unrecognized goes through Triton. The GPU tests
check that results equal Triton's own launcher's across shapes, dtypes, alignments, streams, CUDA-graph
capture and programmatic dependent launch."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from fuselab.kernels._common import fast_launch
from fuselab.kernels._common.fast_launch import bind, specialization


def _params(runtime: int, constexprs: int):
    return [SimpleNamespace(is_constexpr=False)] * runtime + [SimpleNamespace(is_constexpr=True)] * constexprs


def _fake(runtime=3, constexprs=2, scratch=0, name="launch", hooks=()):
    """(kernel, its compiled kernel, the C launcher's calls, the launches through Triton)."""
    calls = []

    def launch(*args):
        calls.append(args)

    launch.__name__ = name
    run = SimpleNamespace(launch=launch, global_scratch_size=scratch, profile_scratch_size=0,
                          launch_cooperative_grid=False, launch_pdl=True)
    compiled = SimpleNamespace(run=run, function=1234, packed_metadata=(4, 1, 0))
    stock = []

    class Kernel:
        params = _params(runtime, constexprs)
        pre_run_hooks = list(hooks)

        def __getitem__(self, grid):
            return lambda *args, **meta: stock.append((grid, args, meta)) or compiled

    return Kernel(), compiled, calls, stock


@pytest.fixture
def fast(monkeypatch):
    """The fast path switched on over fake device, stream and launch hooks."""
    hooks = SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=SimpleNamespace(calls=[]))
    device = SimpleNamespace(index=0)
    monkeypatch.setattr(fast_launch, "FAST", True)
    monkeypatch.setattr(fast_launch, "_binders", {})
    monkeypatch.setattr(fast_launch, "_runtime_knobs", hooks, raising=False)
    monkeypatch.setattr(fast_launch, "_current_device", lambda: device.index, raising=False)
    monkeypatch.setattr(fast_launch, "_raw_stream", lambda index: 99 + index, raising=False)
    return SimpleNamespace(hooks=hooks, device=device)


def _key(*args, **meta):
    return specialization(0, args, meta)[1:]


def test_int_keys_follow_tritons_specialization():
    values = (0, 1, 2, 16, 17, 4096, 2**31 - 1, 2**31, 2**32, 2**31 + 1, -2**31, -2**31 - 1, 2**63 - 1, 2**63,
              2**64 - 1)
    keys = {v: _key(v) for v in values}
    assert keys[1] != keys[17] and keys[1] != keys[2]  # 1 is a constant to Triton
    assert keys[16] == keys[4096] == keys[0] and keys[16] != keys[17]  # divisibility by 16
    assert keys[17] == keys[2] and keys[2**31 - 1] == keys[17]
    assert keys[-2**31] == keys[16]  # still i32
    assert keys[2**31] == keys[2**32] != keys[16]  # i64 apart from i32
    assert keys[2**31 + 1] == keys[-2**31 - 1] == keys[2**63 - 1] != keys[17]
    assert keys[2**63] not in (keys[2**32], keys[16]) and keys[2**64 - 1] not in (keys[2**63 - 1], keys[17])  # u64
    assert _key(True) != _key(1) and _key(1.0) != _key(1) and _key(None) != _key(0)


def test_values_of_one_class_share_a_binding_and_other_classes_get_their_own(fast):
    kernel, _, calls, stock = _fake(runtime=1, constexprs=0)
    for v in (16, 4096, 0, 17, 2, 1, 1, 2**31, 2**32, 3):
        fast_launch.launch(kernel, (1,), v)
    # Through Triton: 16 (then 4096 and 0 bound), 17 (then 2), 1 (then 1), 2**31 (then 2**32), 3 bound.
    assert [args for _, args, _ in stock] == [(16,), (17,), (1,), (2**31,)]
    assert [call[13:] for call in calls] == [(4096,), (0,), (2,), (1,), (2**32,), (3,)]


def test_kinds_are_told_apart(fast):
    kernel, _, calls, stock = _fake(runtime=1, constexprs=0)
    for v in (1, True, 1.0, None, 1, True, 1.0, None):
        fast_launch.launch(kernel, (1,), v)
    assert [args for _, args, _ in stock] == [(1,), (True,), (1.0,), (None,)]  # each kind its own first launch
    assert [call[13] for call in calls] == [1, True, 1.0, None]
    assert [type(call[13]) for call in calls] == [int, bool, float, type(None)]
    assert len(fast_launch._binders[id(kernel)]) == 4


def test_tensor_keys_hold_dtype_and_pointer_alignment():
    buf = torch.zeros(64, dtype=torch.bfloat16)
    aligned, misaligned = buf[:32], buf[1:33]
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 != 0
    assert _key(aligned) != _key(misaligned)
    assert _key(aligned) == _key(buf[8:40])  # 16 bytes further: aligned as well
    assert _key(aligned) != _key(aligned.float())


def test_the_c_launcher_gets_pointers_for_tensors_and_the_rest_as_it_is(fast):
    kernel, _, calls, _ = _fake(runtime=4, constexprs=2)
    x = torch.zeros(8)
    for _ in range(2):
        fast_launch.launch(kernel, (3, 2), x, 7, 0.5, None, BLOCK=4)
    assert calls == [(3, 2, 1, 99, 1234, False, True, None, None, (4, 1, 0), None, None, None,
                      x.data_ptr(), 7, 0.5, None, None, None)]
    weight = torch.nn.Parameter(torch.zeros(8))  # a tensor subclass is a tensor
    fast_launch.launch(kernel, (3, 2), weight, 7, 0.5, None, BLOCK=4)
    fast_launch.launch(kernel, (3, 2), weight, 7, 0.5, None, BLOCK=4)
    assert calls[-1][13] == weight.data_ptr()


def test_keys_hold_the_device_and_keywords_by_name():
    assert specialization(0, (), {}) != specialization(1, (), {})
    assert _key(X=True, Y=False) != _key(Y=True, X=False)
    assert _key(BLOCK=64, num_warps=4) != _key(BLOCK=64, num_warps=8)
    assert _key(launch_pdl=True) != _key(launch_pdl=False)


def test_kernels_devices_and_keywords_get_their_own_bindings(fast):
    kernel_a, _, calls_a, stock_a = _fake(runtime=0, constexprs=0)
    kernel_b, _, calls_b, stock_b = _fake(runtime=0, constexprs=0)
    for kernel in (kernel_a, kernel_b, kernel_a, kernel_b):
        fast_launch.launch(kernel, (1,))
    assert len(stock_a) == len(stock_b) == 1 and len(calls_a) == len(calls_b) == 1  # a binding each
    fast.device.index = 1
    fast_launch.launch(kernel_a, (1,))
    assert len(stock_a) == 2  # another device: Triton compiles for it
    for num_warps in (4, 8, 4, 8):
        fast_launch.launch(kernel_a, (1,), num_warps=num_warps)
    assert len(stock_a) == 4 and len(calls_a) == 3


def test_the_launch_follows_the_current_device_and_its_stream(fast):
    kernel, _, calls, _ = _fake(runtime=1, constexprs=0)
    for index in (0, 0, 1, 1):
        fast.device.index = index
        fast_launch.launch(kernel, (1,), 5)
    assert [call[3] for call in calls] == [99, 100]


def test_each_argument_layout_gets_its_binder_and_keeps_it(fast):
    kernel, _, calls, stock = _fake(runtime=2, constexprs=1)
    x = torch.zeros(8)
    layouts = [(x, None), (x, x), (x, 3), (None, 3)]
    for _ in range(3):
        for args in layouts:
            fast_launch.launch(kernel, (2,), *args, BLOCK=8)
    assert [args for _, args, _ in stock] == layouts  # once each, through Triton
    assert len(calls) == 2 * len(layouts) and len(fast_launch._binders[id(kernel)]) == len(layouts)
    assert [call[13:15] for call in calls[:4]] == [(x.data_ptr(), None), (x.data_ptr(), x.data_ptr()),
                                                   (x.data_ptr(), 3), (None, 3)]


def test_grid_sizes_fill_the_three_dimensions(fast):
    kernel, _, calls, _ = _fake(runtime=0, constexprs=0)
    for grid in ((5,), (5, 6), (5, 6, 7)):
        for _ in range(2):
            fast_launch.launch(kernel, grid)
    assert [call[:3] for call in calls] == [(5, 1, 1), (5, 6, 1), (5, 6, 7)]


@pytest.mark.parametrize("arg", [(1, 2), [1], "s", SimpleNamespace(data_ptr=lambda: 0), torch.float32])
def test_other_argument_kinds_keep_tritons_path(fast, arg):
    kernel, _, calls, stock = _fake(runtime=1, constexprs=0)
    for _ in range(2):
        fast_launch.launch(kernel, (1,), arg)
    assert len(stock) == 2 and not calls and id(kernel) not in fast_launch._binders


def test_new_sizes_of_a_bound_class_launch_bound_and_are_remembered(fast, monkeypatch):
    monkeypatch.setattr(fast_launch, "_EXACT_KEYS", 4)
    kernel, _, calls, stock = _fake(runtime=2, constexprs=0)
    x = torch.zeros(8)
    sizes = [32 * i for i in range(1, 8)]
    for n in sizes + sizes:
        fast_launch.launch(kernel, (n,), x, n)
    assert len(stock) == 1  # one specialization: every size divisible by 16
    assert [call[0] for call in calls] == sizes[1:] + sizes and [call[14] for call in calls] == sizes[1:] + sizes
    (go,) = fast_launch._binders[id(kernel)]
    assert len(go.specializations) == 1 and 0 < len(go.exact) <= 4  # the exact keys start over when full


def test_another_kind_in_a_bound_position_is_never_taken_for_the_bound_one(fast):
    kernel, _, calls, stock = _fake(runtime=1, constexprs=0)
    x = torch.zeros(4)
    fast_launch.launch(kernel, (1,), 16)
    fast_launch.launch(kernel, (1,), 16)
    odd = (torch.tensor(16), 16.0, True, None, (16,), x, "16")
    for a in odd:
        fast_launch.launch(kernel, (1,), a)
    assert len(calls) == 1  # only the second 16
    assert len(stock) == 1 + len(odd) and all(args[0] is a for (_, args, _), a in zip(stock[1:], odd))


def test_bind_takes_only_what_it_can_launch_as_triton_would():
    kernel, compiled, _, _ = _fake()
    bound = bind(kernel, compiled, 3)
    assert bound is not None and bound.tail == (None, None) and bound.pdl and bound.function == 1234
    assert bind(kernel, compiled, 4) is None  # a constexpr passed by position
    assert bind(kernel, compiled, 2) is None  # a runtime parameter left to a default or a keyword
    assert bind(*_fake(scratch=256)[:2], 3) is None  # per-launch scratch memory
    assert bind(*_fake(name="inner")[:2], 3) is None  # tensor descriptors converted in Python
    assert bind(*_fake(hooks=[print])[:2], 3) is None
    assert bind(kernel, None, 3) is None  # Triton returned no compiled kernel


def test_a_launch_goes_through_triton_once_then_straight_to_the_c_launcher(fast):
    kernel, _, calls, stock = _fake()
    x = torch.zeros(8)
    for _ in range(3):
        fast_launch.launch(kernel, (5, 2), x, 16, 0.5, BLOCK=32, num_warps=4)
    assert len(stock) == 1 and stock[0] == ((5, 2), (x, 16, 0.5), {"BLOCK": 32, "num_warps": 4})
    assert calls == [(5, 2, 1, 99, 1234, False, True, None, None, (4, 1, 0), None, None, None,
                      x.data_ptr(), 16, 0.5, None, None)] * 2
    fast_launch.launch(kernel, (5,), x, 17, 0.5, BLOCK=32, num_warps=4)  # a new specialization
    fast_launch.launch(kernel, (5,), x, 16, 0.5, BLOCK=64, num_warps=4)
    assert len(stock) == 3 and len(calls) == 2


def test_a_kernel_that_cannot_be_bound_keeps_tritons_path(fast):
    kernel, _, calls, stock = _fake(scratch=256)
    x = torch.zeros(8)
    for _ in range(3):
        fast_launch.launch(kernel, (1,), x, 16, 0.5)
    assert len(stock) == 3 and not calls
    kernel, _, calls, stock = _fake(runtime=3, constexprs=2)
    for _ in range(3):
        fast_launch.launch(kernel, (1,), x, 16, 0.5, 4)  # a constexpr by position
    assert len(stock) == 3 and not calls


def test_hooks_and_unknown_arguments_keep_tritons_path(fast):
    kernel, _, calls, stock = _fake()
    x = torch.zeros(8)
    fast_launch.launch(kernel, (1,), x, 16, 0.5)
    fast.hooks.launch_enter_hook.calls.append(print)  # a profiler's hook: Triton builds its launch metadata
    fast_launch.launch(kernel, (1,), x, 16, 0.5)
    fast.hooks.launch_enter_hook.calls.clear()
    fast_launch.launch(kernel, lambda meta: (1,), x, 16, 0.5)  # a grid function
    for _ in range(2):
        fast_launch.launch(kernel, (1,), x, (16,), 0.5)
    assert len(stock) == 5 and not calls
    fast_launch.launch(kernel, (1,), x, 16, 0.5)
    assert len(calls) == 1


def test_stock_launches_go_through_triton_for_a_while(fast):
    kernel, _, calls, stock = _fake()
    x = torch.zeros(8)
    fast_launch.launch(kernel, (1,), x, 16, 0.5)
    with fast_launch.stock_launches():
        fast_launch.launch(kernel, (1,), x, 16, 0.5)
    fast_launch.launch(kernel, (1,), x, 16, 0.5)
    assert len(stock) == 2 and len(calls) == 1 and fast_launch.FAST


def test_an_error_of_the_c_launcher_reaches_the_caller(fast):
    kernel, compiled, _, stock = _fake(runtime=1, constexprs=0)

    def launch(*args):
        raise RuntimeError("Triton Error [CUDA]: invalid argument")

    compiled.run.launch = launch
    fast_launch.launch(kernel, (1,), 5)
    with pytest.raises(RuntimeError, match="invalid argument"):
        fast_launch.launch(kernel, (1,), 5)
    assert len(stock) == 1


def test_a_prepared_launch_passes_what_launch_passes_and_keeps_its_keywords(fast):
    kernel, _, calls, stock = _fake()
    x = torch.zeros(8)
    meta = {"BLOCK": 32, "num_warps": 4}
    prepared = fast_launch.prepare(kernel, **meta)
    meta["BLOCK"] = 64  # the caller's dict: copied, not read again
    for _ in range(3):
        prepared((5, 2), x, 16, 0.5)
    assert stock == [((5, 2), (x, 16, 0.5), {"BLOCK": 32, "num_warps": 4})]
    fast_launch.launch(kernel, (5, 2), x, 16, 0.5, BLOCK=32, num_warps=4)  # its own binders: through Triton
    fast_launch.launch(kernel, (5, 2), x, 16, 0.5, BLOCK=32, num_warps=4)
    assert len(stock) == 2 and len(calls) == 3 and calls[0] == calls[-1]
    assert len(fast_launch._binders[id(kernel)]) == 1  # the prepared launch's binder is not the kernel's


def test_a_prepared_launch_keys_its_arguments_and_the_device(fast):
    kernel, _, calls, stock = _fake(runtime=2, constexprs=1)
    prepared = fast_launch.prepare(kernel, BLOCK=8)
    x = torch.zeros(8)
    through_triton = []
    for args in ((x, 16), (x, 16), (x.double(), 16), (x, 17), (x, 17), (x, None), (x, None), (x[1:], 16)):
        before = len(stock)
        prepared((2,), *args)
        through_triton.append(len(stock) > before)
    # The first of each dtype, int class, layout and alignment goes through Triton, the rest are bound.
    assert through_triton == [True, False, True, True, False, True, False, True] and len(calls) == 3
    fast.device.index = 1
    prepared((2,), x, 16)
    assert len(stock) == 6 and calls[-1][3] == 99 + 0  # another device compiles; its stream is read per launch
    prepared((2,), x, 16)
    assert calls[-1][3] == 100


def test_a_prepared_launch_keeps_tritons_path_where_launch_does(fast):
    kernel, _, calls, stock = _fake()
    prepared = fast_launch.prepare(kernel, BLOCK=32)
    x = torch.zeros(8)
    prepared((1,), x, 16, 0.5)
    fast.hooks.launch_exit_hook.calls.append(print)
    prepared((1,), x, 16, 0.5)
    fast.hooks.launch_exit_hook.calls.clear()
    with fast_launch.stock_launches():
        prepared((1,), x, 16, 0.5)
    prepared(lambda meta: (1,), x, 16, 0.5)
    prepared((1,), x, (16,), 0.5)
    assert len(stock) == 5 and not calls and all(meta == {"BLOCK": 32} for _, _, meta in stock)
    prepared((1,), x, 16, 0.5)
    assert len(calls) == 1


def test_interpreter_keeps_tritons_launcher():
    if not torch.cuda.is_available():
        assert not fast_launch.FAST


# --------------------------------------------------------------------------------------------
# On a GPU: the same results as Triton's own launcher
# --------------------------------------------------------------------------------------------

needs_fast_path = pytest.mark.skipif(not fast_launch.FAST, reason="fast launches need Triton 3.6 on a GPU")


def _bound_entries():
    """What every specialization seen so far is bound to: a Bound, or None for Triton's path."""
    return [b for binders in fast_launch._binders.values() for go in binders for b in go.specializations.values()]


def _triton_path_launches(monkeypatch, fn):
    """(fn(), how many of its launches went through Triton's own path, JITFunction.run)."""
    from triton.runtime.jit import JITFunction

    real, count = JITFunction.run, [0]

    def counted(self, *args, **kwargs):
        count[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    try:
        return fn(), count[0]
    finally:
        monkeypatch.setattr(JITFunction, "run", real)


def _stock_and_fast(monkeypatch, fn):
    """fn() through Triton's launcher, then twice through the bound one (the first call binds). The
    launches of `launch` and of `prepare`'s launchers count alike: by Triton's path, which they avoid."""
    monkeypatch.setattr(fast_launch, "FAST", False)
    expected, stock = _triton_path_launches(monkeypatch, fn)
    monkeypatch.setattr(fast_launch, "FAST", True)
    fn()
    got, unbound = _triton_path_launches(monkeypatch, fn)
    torch.cuda.synchronize()
    assert unbound < stock, "nothing was bound: every launch went through Triton"
    return expected, got


def _assert_same(expected, got):
    expected, got = (t if isinstance(t, tuple) else (t,) for t in (expected, got))
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def _decode_ops(dtype, offset):
    """The engine's and fuselab.patch's decode ops, and the other ops that launch through fast_launch, at a
    small shape; `offset` elements into each buffer (1: misaligned pointers)."""
    from fuselab import kernels

    torch.manual_seed(0)
    dev = "cuda"

    def make(*shape, scale=1.0):
        n = 1
        for s in shape:
            n *= s
        return (torch.randn(n + offset, device=dev, dtype=dtype) * scale)[offset:].view(*shape)

    x, res, w = make(2, 512), make(2, 512), make(512) + 1
    gate_up, weight = make(1, 2 * 768), make(256, 512, scale=0.05)
    qkv = make(2, (8 + 2 * 2) * 64)
    q, k, v = qkv[:, :512].view(2, 8, 64), qkv[:, 512:640].view(2, 2, 64), qkv[:, 640:].view(2, 2, 64)
    cos_sin = kernels.rope_cos_sin(256, 64, device=dev)
    k_cache, v_cache = make(16, 16, 2, 64), make(16, 16, 2, 64)
    positions = torch.tensor([3, 40], device=dev)
    slots = torch.tensor([3, 40], device=dev, dtype=torch.int32)
    tables = torch.arange(16, device=dev, dtype=torch.int32).view(2, 8)
    lens = torch.tensor([4, 41], device=dev, dtype=torch.int32)
    logits = make(2, 5000)
    q_dense, counters = make(2, 8, 64), torch.zeros(4, device=dev, dtype=torch.int32)
    return {
        "rms_norm": lambda: kernels.rms_norm(x, w, 1e-6),
        "rms_norm residual": lambda: kernels.rms_norm(x, w, 1e-6, residual=res),
        "silu_and_mul": lambda: kernels.silu_and_mul(gate_up),
        "swiglu": lambda: kernels.swiglu(x, res),
        "linear": lambda: kernels.linear(x[:1], weight),
        "argmax": lambda: kernels.argmax(logits),
        "rope_and_store_kv": lambda: kernels.rope_and_store_kv(q, k, v, positions, cos_sin, k_cache.clone(),
                                                               v_cache.clone(), slots),
        "decode_attention": lambda: kernels.decode_attention(q, k_cache, v_cache, tables, lens, max_seq_len=2048),
        "decode_attention dense": lambda: kernels.decode_attention(q_dense, k_cache, v_cache, tables, lens,
                                                                   max_seq_len=2048, counters=counters),
        "apply_rope": lambda: kernels.apply_rope(q, k, positions, cos_sin),
        "add": lambda: kernels.add(x, res),
        "bias_act": lambda: kernels.bias_act(x, w),
        "layer_norm": lambda: kernels.layer_norm(x, w, res[0], residual=res),
        "softmax": lambda: kernels.softmax(x),
    }


@pytest.mark.gpu
@needs_fast_path
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("offset", [0, 1])
def test_decode_ops_match_tritons_launcher(monkeypatch, dtype, offset):
    for name, fn in _decode_ops(dtype, offset).items():
        expected, got = _stock_and_fast(monkeypatch, fn)
        _assert_same(expected, got)


@pytest.mark.gpu
@needs_fast_path
def test_aligned_then_misaligned_then_aligned_inputs_each_get_their_kernel():
    from fuselab import kernels
    from fuselab.kernels import reference

    buf = torch.randn(3 * 4096 + 1, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    for offset in (0, 1, 0, 1):
        x = buf[offset:offset + 3 * 4096].view(3, 4096)
        torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_fast_path
def test_quantized_linear_matches_tritons_launcher(monkeypatch):
    from fuselab import kernels

    torch.manual_seed(0)
    weight = kernels.quantize_weight(torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) * 0.05, "int4")
    for rows in (1, 5):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        _assert_same(*_stock_and_fast(monkeypatch, lambda: kernels.quantized_linear(x, weight)))


@pytest.mark.gpu
@needs_fast_path
def test_launches_follow_the_current_stream(monkeypatch):
    ops = _decode_ops(torch.bfloat16, 0)
    expected = {name: _stock_and_fast(monkeypatch, fn)[0] for name, fn in ops.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = {name: fn() for name, fn in ops.items()}
    side.synchronize()
    for name in ops:
        _assert_same(expected[name], got[name])

    # A launch on another stream than the current one would run before the copy it must follow.
    from fuselab import kernels

    x_new, w = torch.randn(4, 4096, device="cuda"), torch.rand(4096, device="cuda") + 0.5
    expected = kernels.rms_norm(x_new, w, 1e-6)
    x = torch.zeros_like(x_new)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x.copy_(x_new)
        got = kernels.rms_norm(x, w, 1e-6)
    side.synchronize()
    assert torch.equal(got, expected)


@pytest.mark.gpu
@needs_fast_path
def test_bound_launches_are_captured_and_replayed_by_a_cuda_graph(monkeypatch):
    from fuselab.kernels import dependent_launches

    ops = _decode_ops(torch.bfloat16, 0)
    for pdl in (False, True):
        expected = {name: _stock_and_fast(monkeypatch, fn)[0] for name, fn in ops.items()}
        with dependent_launches() if pdl else contextlib.nullcontext():
            for fn in ops.values():
                fn()  # binds the PDL variants too
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = {name: fn() for name, fn in ops.items()}
        graph.replay()
        torch.cuda.synchronize()
        for name in ops:
            _assert_same(expected[name], outs[name])
        if pdl and torch.cuda.get_device_capability()[0] >= 9:
            assert any(b is not None and b.pdl for b in _bound_entries())
