"""Side-by-side benchmarks, one module per subject; each has add_arguments(parser) and run(args) -> int.

What every subject shares lives here: the command line a result records, arguments, table cells
and error texts, and writing it out.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path


def command_line() -> str:
    """The command that ran this benchmark, spelled as the user would type it."""
    if Path(sys.argv[0]).name in ("fuselab", "__main__.py"):
        return shlex.join(["fuselab", *sys.argv[1:]])
    return shlex.join(sys.argv)


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive ints, in the order given."""
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def batch_sizes(text: str) -> list[int]:
    """An argparse type: comma-separated positive ints, sorted, each once."""
    return sorted(set(int_list(text)))


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def output_dir(text: str) -> str:
    """An argparse type: a folder the results can be written to (created when they are), checked
    before a benchmark spends minutes measuring."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{str(existing)!r} (in {text!r}) is not a directory")
    try:
        # Creating a file is the only test that holds for every user (root included) and file system.
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write in {str(existing)!r}: {e.strerror}") from None
    return text


def error_text(err: Exception, limit: int = 200) -> str:
    """The exception's type and first line, for a results table cell."""
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:limit]


def fmt(value: float | None, spec: str) -> str:
    """A table cell: the value formatted, or a dash where it was not measured."""
    return "—" if value is None else format(value, spec)


def markdown_table(columns, rows) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *("| " + " | ".join(r) + " |" for r in rows)]


def write_json(result: dict, out: str | Path, name: str) -> Path:
    """`result` as out/NAME.json (the folder is created); returns the path."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
