"""Importing an op's optional Gluon path (Triton's experimental dialect): absent on a Triton without it."""

from __future__ import annotations

import importlib
from types import ModuleType


def optional_gluon(module_name: str) -> ModuleType | None:
    """The module `module_name`, or None when the Triton installed lacks what it imports from Triton.

    Only a missing Triton module or name means "no Gluon here": any other import error (one of our own
    modules or names) is a bug and is raised, not turned into a silent fallback to the Triton kernels.
    """
    try:
        return importlib.import_module(module_name)
    except ImportError as missing:
        if not (missing.name or "").startswith("triton"):
            raise
        return None
