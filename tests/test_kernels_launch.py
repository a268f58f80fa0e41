import triton

from fuselab.kernels._launch import cdiv, next_power_of_2


def test_host_helpers_agree_with_tritons():
    for n in list(range(0, 70)) + [127, 128, 129, 4095, 4096, 4097, 128256, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == max(1, triton.next_power_of_2(n)), n
        for d in (1, 2, 3, 16, 1024):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
