"""fuselab: measure and remove kernel-launch overhead, host-device syncs and inter-kernel memory
traffic in PyTorch GPU inference."""

from fuselab import device  # noqa: F401  (first: chooses compiled or interpreted Triton before any kernel is defined)
# `bench`, the timing harness, is fuselab.timing.bench: the name fuselab.bench is the benchmark subjects' package.
from fuselab.timing import Timer, Timers, cuda_timer

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "Timer", "Timers", "cuda_timer", "patch", "__version__"]

# Names whose modules load Triton and the kernels: imported on first use, so that `import fuselab`
# (and every `fuselab --help`) stays quick.
_LAZY = {"patch": "fuselab.patching", "LLM": "fuselab.engine", "SamplingParams": "fuselab.engine"}
# Subpackages reachable as attributes (`fuselab.optim.FusedAdamW`), loaded on first use for the same reason.
_SUBMODULES = ("doctor", "engine", "graphs", "kernels", "optim", "probe")


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"fuselab.{name}")
    else:
        raise AttributeError(f"module 'fuselab' has no attribute {name!r}")
    globals()[name] = value
    return value
