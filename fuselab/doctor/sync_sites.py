"""Record the exact source line of every host sync while the profiler runs.

The profiler names a Python frame by the line its function starts on (or line 0 for a script's
module), not by the statement that is running, so a trace alone cannot say which `.item()` synced.
While it records, torch's sync debug mode ("warn") makes every synchronizing op (`.item()`,
`.cpu()`, `.tolist()`, `torch.nonzero`, a blocking copy, ...) raise a warning as the op returns to
Python; the hook here takes the Python stack at that moment, picks the user's frame (the innermost
one outside torch, fuselab, the standard library and installed packages, so a sync inside a library
call is placed at the user's line that called it), and writes it into the trace as a zero-length
range named SYNC_SITE + "file.py:LINE (function)", just after the sync it belongs to.

`torch.cuda.synchronize()` and event waits raise no warning; their lines stay the profiler's.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Sequence
from types import FrameType

import torch
from torch.profiler import record_function

from fuselab.device import has_cuda

SYNC_SITE = "fuselab.doctor.sync_site "
SYNC_WARNING = "called a synchronizing CUDA operation"

Frame = tuple[str, int, str]  # (file, line, function)


def library_dirs() -> tuple[str, ...]:
    """Where code that is not the user's lives: torch, fuselab, the standard library, installed packages."""
    import fuselab

    paths = sysconfig.get_paths()
    dirs = {os.path.dirname(torch.__file__), os.path.dirname(fuselab.__file__),
            paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]}
    return tuple(sorted(os.path.join(os.path.realpath(d), "") for d in dirs))


def user_frame(stack: Sequence[Frame], libraries: Sequence[str]) -> Frame | None:
    """The innermost frame of user code in `stack` (innermost first); None when every frame is a library's.

    A frame is a library's when its file lies under one of `libraries` (directories ending in a
    separator) or is not a file at all ("<frozen ...>", "<string>").
    """
    for file, line, function in stack:
        if file.startswith("<"):
            continue
        path = os.path.realpath(file)
        if not any(path.startswith(lib) for lib in libraries):
            return file, line, function
    return None


def site_name(frame: Frame) -> str:
    file, line, function = frame
    return f"{SYNC_SITE}{file}:{line} ({function})"


def mark_site(frame: Frame) -> None:
    """Write a sync site into the running profiler's trace as a zero-length range."""
    with record_function(site_name(frame)):
        pass


def _stack(frame: FrameType | None) -> list[Frame]:
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out


class SyncSiteRecorder:
    """While active, hand the user frame of each synchronizing op to `on_site` (by default, mark it in the
    running profiler's trace); `libraries` are the directories whose frames are not the user's."""

    def __init__(self, libraries: Sequence[str] | None = None, on_site: Callable[[Frame], None] = mark_site) -> None:
        self._libraries = tuple(libraries) if libraries is not None else library_dirs()
        self._on_site = on_site
        self._filter: tuple | None = None  # the "always" filter this recorder added, while active
        self._forward = None
        self._debug_mode = 0  # torch's sync debug mode before this recorder set it

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING not in str(message):
            self._forward(message, category, filename, lineno, file, line)
            return
        frame = user_frame(_stack(sys._getframe(1)), self._libraries)
        if frame is not None:
            self._on_site(frame)

    def start(self) -> None:
        # "always": the default filter shows a warning once per place, and every sync must be seen.
        # Only this filter and the display hook are changed (and undone), not the filters the script sets.
        warnings.filterwarnings("always", message=SYNC_WARNING)
        self._filter = warnings.filters[0]
        self._forward = warnings.showwarning
        warnings.showwarning = self._show
        if has_cuda():
            self._debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if self._filter is None:
            return
        if has_cuda():
            torch.cuda.set_sync_debug_mode(self._debug_mode)
        if warnings.showwarning == self._show:
            warnings.showwarning = self._forward
        if self._filter in warnings.filters:
            warnings.filters.remove(self._filter)
        self._filter = None

    def __enter__(self) -> SyncSiteRecorder:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
