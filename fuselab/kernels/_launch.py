"""Integer helpers for launch metadata on the host.

Triton's own `triton.cdiv` and `triton.next_power_of_2` are constexpr functions: called from host
code, each goes through a wrapper that unwraps its arguments first, a few µs a call. A launcher
that needs several of them per call pays that at every decode step; these are plain Python.
"""

import functools
import os

import torch

# Programmatic dependent launch (sm_90+), an experiment switched on by FUSELAB_PDL=1: the decode
# step's kernels are launched so that each may start while the one before it finishes; each waits
# (gdc_wait) before it reads what that one wrote.
PDL = os.environ.get("FUSELAB_PDL") == "1" and os.environ.get("TRITON_INTERPRET") != "1"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


@functools.cache
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device); None index: the current one."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
