"""What the serve tests share: a tiny checkpoint with a word-level tokenizer and a chat template,
and an HTTP server in a thread on a free port of 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from engine_checkpoints import build_hf_model, save_checkpoint

SPECIALS = ("<s>", "</s>", "<|user|>", "<|assistant|>")
WORDS = 256 - len(SPECIALS)  # w0 ... w251, then the special tokens: the model's 256 ids
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}<|{{ m['role'] }}|> {{ m['content'] | trim }} {{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def hf_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A transformers tokenizer over a word-level vocabulary: word wN is token N, so text and
    tokens map one to one."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(WORDS)} | {s: WORDS + i for i, s in enumerate(SPECIALS)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="w0",
                                   additional_special_tokens=list(SPECIALS[2:]), chat_template=chat_template)


def chat_checkpoint(path: Path, max_position_embeddings: int = 1024) -> Path:
    """The llama3 test checkpoint (256 ids, no end-of-sequence token) with that tokenizer saved beside it."""
    save_checkpoint(build_hf_model("llama3", max_position_embeddings=max_position_embeddings), path)
    hf_tokenizer().save_pretrained(path)
    return path


class ServerThread:
    """uvicorn serving `app` from a thread, on a port the OS picked; start() returns once it listens."""

    def __init__(self, app) -> None:
        import uvicorn

        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
