"""Side-by-side benchmarks, one module per subject; each has add_arguments(parser) and run(args) -> int.

What every subject shares lives here: the command line a result records, and writing it out.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


def command_line() -> str:
    """The command that ran this benchmark, spelled as the user would type it."""
    if Path(sys.argv[0]).name in ("fuselab", "__main__.py"):
        return shlex.join(["fuselab", *sys.argv[1:]])
    return shlex.join(sys.argv)


def write_json(result: dict, out: str | Path, name: str) -> Path:
    """`result` as out/NAME.json (the folder is created); returns the path."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
