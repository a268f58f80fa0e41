"""Tokenizers: a checkpoint's tokenizer.json (through the `tokenizers` library), or bytes for presets.

Presets have random weights and no vocabulary of their own; reading a string prompt as its UTF-8
bytes (token id = byte value) still lets one run from text, e.g. `fuselab generate --model tiny`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from fuselab.engine.config import CheckpointError

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class HFTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise CheckpointError(f"{path}: not a readable tokenizer ({e})") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # With the special tokens the checkpoint's post-processor adds (Llama's BOS), as transformers does;
        # without them for text that holds them already (a rendered chat template).
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


class ByteTokenizer:
    """Token id = byte value; ids past 255 (a random model may produce them) decode to nothing."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # bytes have no special tokens to add

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


def load_tokenizer(model_dir: Path | None) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory (None if it has no tokenizer.json); for a preset
    (model_dir None), bytes."""
    if model_dir is None:
        return ByteTokenizer()
    path = model_dir / TOKENIZER_FILE
    return HFTokenizer(path) if path.is_file() else None
