"""fuselab: measure and remove kernel-launch overhead, host-device syncs and inter-kernel memory
traffic in PyTorch GPU inference."""

from fuselab import device  # noqa: F401  (first: chooses compiled or interpreted Triton before any kernel is defined)
from fuselab.patch import patch
from fuselab.timing import Timer, Timers, bench, cuda_timer

__version__ = "0.1.0"
__all__ = ["Timer", "Timers", "bench", "cuda_timer", "patch", "__version__"]
