import threading

import pytest
import torch
import triton

from fuselab.kernels import argmax, linear, rms_norm, swiglu
from fuselab.kernels._common import launch as _launch
from fuselab.kernels._common.launch import cdiv, dependent_launches, next_power_of_2, use_pdl


def test_host_helpers_agree_with_tritons():
    for n in list(range(0, 70)) + [127, 128, 129, 4095, 4096, 4097, 128256, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == max(1, triton.next_power_of_2(n)), n
        for d in (1, 2, 3, 16, 1024):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_sm_count_of_a_cpu_device_is_the_interpreters_few():
    """Launch configs that split work to fill the SMs see a few on the CPU, so small tests reach those paths."""
    assert _launch.sm_count(torch.device("cpu")) == 4
    if torch.cuda.is_available():
        assert _launch.sm_count(torch.device("cuda")) == torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("regs,shared,expected", [
    (128, 114 * 1024, 132),  # registers for 2 (8 warps at 128 a thread), shared memory for 1 (with 1 KiB kept a program)
    (128, 113 * 1024, 264),  # shared memory for exactly 2
    (96, 60 * 1024, 264),  # registers and shared memory for 2 (3 would need 73728 registers)
    (32, 8 * 1024, 1056),  # threads: 2048 an SM, 256 a program
    (255, 1024, 132),  # more registers than half an SM: alone, but it runs
])
def test_resident_programs_is_the_tightest_of_threads_registers_and_shared_memory(monkeypatch, regs, shared, expected):
    from types import SimpleNamespace

    compiled = SimpleNamespace(_init_handles=lambda: None, n_regs=regs, metadata=SimpleNamespace(num_warps=8, shared=shared))
    props = SimpleNamespace(max_threads_per_multi_processor=2048, shared_memory_per_multiprocessor=228 * 1024,
                            multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(_launch, "_registers_per_sm", lambda index: 65536)
    assert _launch.resident_programs(compiled, torch.device("cuda", 0)) == expected


def test_dependent_launches_is_scoped_and_cpu_never_uses_it():
    cpu = torch.device("cpu")
    assert not use_pdl(cpu)
    with dependent_launches():
        assert not use_pdl(cpu)
        with dependent_launches():
            pass
        assert _launch._pdl_scope.get()  # the inner block put back the outer one's state
    assert not _launch._pdl_scope.get()


def test_dependent_launches_hold_for_their_own_thread_only():
    seen = []
    with dependent_launches():
        other = threading.Thread(target=lambda: seen.append(_launch._pdl_scope.get()))
        other.start()
        other.join()
        assert _launch._pdl_scope.get()
    assert seen == [False]


def _decode_like_chain(x, residual, norm_weight, w_gate_up, w_down):
    y, h = rms_norm(x, norm_weight, 1e-5, residual=residual)
    gate_up = linear(y, w_gate_up)
    act = swiglu(*gate_up.chunk(2, dim=-1))
    return argmax(linear(act, w_down)), h


@pytest.mark.gpu
def test_dependent_launches_give_the_same_results_in_a_cuda_graph():
    """Kernels that may start before the kernel before them ends still read only its finished output."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    x, residual = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16), torch.randn(1, 2048, device=dev,
                                                                                      dtype=torch.bfloat16)
    args = (x, residual, torch.rand(2048, device=dev, dtype=torch.bfloat16) + 0.5,
            torch.randn(2 * 2816, 2048, device=dev, dtype=torch.bfloat16) * 0.02,
            torch.randn(2048, 2816, device=dev, dtype=torch.bfloat16) * 0.02)
    expected = _decode_like_chain(*args)
    with dependent_launches():
        assert use_pdl(dev) == (torch.cuda.get_device_capability(dev)[0] >= 9)
        _decode_like_chain(*args)  # compiles the PDL variants outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = _decode_like_chain(*args)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_backward_row_groups_leave_few_partial_rows():
    """One or two programs an SM (as measured fastest with their partial sums), every row covered once."""
    from fuselab.kernels._common.row_config import _row_groups

    assert _row_groups(16384, 8, 132) == (132, 125)  # two an SM would give each 62 rows: one an SM
    assert _row_groups(4096, 8, 132) == (256, 16)  # two an SM: 16 rows each
    assert _row_groups(16384, 16, 132) == (132, 125)
    assert _row_groups(16384, 4, 132) == (512, 32)  # narrow rows, 4 warps: four an SM
    assert _row_groups(1, 8, 132) == (1, 1)
    for rows in (1, 7, 131, 264, 265, 5000):
        programs, per_program = _row_groups(rows, 8, 132)
        assert (programs - 1) * per_program < rows <= programs * per_program
