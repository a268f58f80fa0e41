"""Integer helpers for launch metadata on the host.

Triton's own `triton.cdiv` and `triton.next_power_of_2` are constexpr functions: called from host
code, each goes through a wrapper that unwraps its arguments first, a few µs a call. A launcher
that needs several of them per call pays that at every decode step; these are plain Python.
"""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1
