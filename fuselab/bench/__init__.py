"""Side-by-side benchmarks, one module per subject; each has add_arguments(parser) and run(args) -> int.

What every subject shares lives here: the command line a result records, arguments, table cells
and error texts, and writing it out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
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
