"""What this machine is: the GPU, the software versions, its measured ceilings, and how Triton runs.

Everything above this floor asks here instead of probing torch.cuda itself, so that a CPU-only
machine degrades the same way everywhere.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Triton decides between compiled and interpreted kernels when a kernel is defined, so the switch
# has to be thrown before any `@triton.jit` runs. Without a CUDA GPU, compiled kernels cannot run
# at all: fall back to the interpreter, which executes the same kernels on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def has_cuda() -> bool:
    return torch.cuda.is_available()


def triton_interpreted() -> bool:
    """True when Triton kernels run through the interpreter (CPU tensors) rather than compiled."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_device() -> torch.device:
    return torch.device("cuda") if has_cuda() else torch.device("cpu")


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a missing or broken optional package is just "absent"
        return None


def recover_from_failed_capture(caller_stream: torch.cuda.Stream) -> None:
    """Undo what a failed CUDA-graph capture leaves behind: the capture's stream and the CUDA
    random generators.

    `torch.cuda.graph` raises from capture_end before it leaves its stream context, so its side
    stream stays current: `caller_stream` is made current again. A capture that raises midway never
    runs the generators' capture epilogue, so they stay in capture mode and the next random op
    outside a graph fails ("Offset increment outside graph capture"). Swapping in a fresh copy of
    each generator's state (same seed and offset, not capturing) puts them back in order.
    """
    torch.cuda.set_stream(caller_stream)
    for gen in torch.cuda.default_generators:
        gen.graphsafe_set_state(gen.clone_state())


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    kind: str  # "cuda" or "cpu"
    compute_capability: str | None
    sm_count: int | None
    memory_gib: float | None
    l2_mib: float | None
    torch: str
    triton: str | None
    cuda: str | None
    python: str

    def to_dict(self) -> dict:
        return asdict(self)


def device_info() -> DeviceInfo:
    """Describe the current device and the software stack, for results files and report headers."""
    common = dict(
        torch=torch.__version__,
        triton=_version("triton"),
        cuda=torch.version.cuda,
        python=platform.python_version(),
    )
    if not has_cuda():
        return DeviceInfo(
            name=platform.processor() or platform.machine(), kind="cpu", compute_capability=None,
            sm_count=None, memory_gib=None, l2_mib=None, **common,
        )
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return DeviceInfo(
        name=p.name,
        kind="cuda",
        compute_capability=f"{p.major}.{p.minor}",
        sm_count=p.multi_processor_count,
        memory_gib=round(p.total_memory / 2**30, 1),
        l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1) or None,
        **common,
    )


@dataclass(frozen=True)
class Ceilings:
    """The two numbers every roofline needs: how fast bytes move and how fast bf16 FLOPs retire."""

    copy_bandwidth_gbs: float  # device-to-device copy, bytes read + written, GB/s
    bf16_tflops: float  # dense bf16 matrix multiply
    source: str  # where the figures came from

    def memory_time_us(self, nbytes: float) -> float:
        return nbytes / (self.copy_bandwidth_gbs * 1e3)

    def compute_time_us(self, flops: float) -> float:
        return flops / (self.bf16_tflops * 1e6)


# Stated figures for when nothing was measured on this machine: an H200's (4.23 TB/s copy, ~780 TFLOP/s
# bf16 on random data).
STATED_CEILINGS = Ceilings(copy_bandwidth_gbs=4230.0, bf16_tflops=780.0, source="stated (H200 figures)")


def probe_cache_path() -> Path:
    """Where `fuselab probe` leaves its latest result for the other tools ($FUSELAB_PROBE overrides)."""
    env = os.environ.get("FUSELAB_PROBE")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "fuselab" / "probe.json"


def ceilings(path: str | os.PathLike | None = None) -> Ceilings:
    """Measured ceilings from a probe result (given path, else the cached last probe), else the stated table."""
    candidate = Path(path) if path is not None else probe_cache_path()
    if candidate.is_file():
        data = json.loads(candidate.read_text())
        c = data.get("ceilings", {})
        if c.get("copy_bandwidth_gbs") and c.get("bf16_tflops"):
            return Ceilings(c["copy_bandwidth_gbs"], c["bf16_tflops"], source=f"measured ({candidate})")
    elif path is not None:
        raise FileNotFoundError(f"probe result not found: {candidate} (run `fuselab probe --json {candidate}`)")
    # On another GPU the H200's figures misstate every roofline percentage: say so where they are printed.
    name = torch.cuda.get_device_name() if has_cuda() else None
    if name is not None and "H200" not in name:
        return Ceilings(STATED_CEILINGS.copy_bandwidth_gbs, STATED_CEILINGS.bf16_tflops,
                        source=f"stated (H200 figures, not this {name}'s: run `fuselab probe` to measure them)")
    return STATED_CEILINGS
