"""AsyncLLM: the engine as a service. Requests arrive at any time, from asyncio code, join the
running batch at the next step (continuous batching across callers), and stream their text back
as the host reads their tokens.

One engine thread owns the LLM and its scheduler. Requests and aborts reach it through a list
under a lock, drained at the top of each step; with nothing to do it sleeps on a condition.
Each step's output goes back to the requests' asyncio queues in one loop.call_soon_threadsafe
per event loop, so the engine never waits on a client and a client never waits on the GPU.
Tokens become text on the engine thread, incrementally, which is where stop strings are found:
a request that hits one finishes at once and gives its KV blocks back, as does one aborted.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence as SequenceType

import torch

from fuselab.engine.llm import LLM
from fuselab.engine.sampling_params import SamplingParams
from fuselab.engine.sequence import Sequence, SequenceStatus
from fuselab.engine.tokenizer import Tokenizer

DEFAULT_MAX_WAITING = 1024


@dataclass(frozen=True)
class RequestDelta:
    """What one request gained since its previous delta."""

    text: str  # new text: "" while held back (a partial character, a possible stop string) or without a tokenizer
    token_ids: tuple[int, ...]  # new tokens, the stop token included
    finish_reason: str | None  # on the last delta: "stop", "length" or "abort"


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions: int


class EngineBusy(RuntimeError):
    """The engine holds as many unfinished requests as it accepts: try again later."""


class EngineDead(RuntimeError):
    """The engine thread has stopped, on an error or by close()."""


class TextStream:
    """Incremental detokenization of one request's output, with stop strings.

    Each token decodes only a short window of recent tokens (the previous window and the new
    tokens; the text is their difference), so a token costs the same at any output length. Text
    ending in a partial UTF-8 character waits for the rest, and the last len(longest stop) - 1
    characters are held back while a stop string could still begin there: streamed text is never
    taken back."""

    def __init__(self, tokenizer: Tokenizer, stop: SequenceType[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = self._read = 0  # the window: ids[prefix:read] is decoded already
        self.text = ""
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._sent = 0  # characters of text handed out
        self._searched = 0  # characters of text searched for stop strings

    def add(self, token_id: int) -> bool:
        """Add a token; True when the text now holds a stop string, which is cut off with
        everything after it."""
        self._ids.append(token_id)
        return self._decode(flush=False)

    def _decode(self, flush: bool) -> bool:
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix:self._read])
        after = decode(self._ids[self._prefix:])
        if len(after) > len(before) and (flush or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        return self._cut_at_stop()

    def finish(self) -> bool:
        """The output ended: decode what waited for more bytes. True when that completes a stop string."""
        return self._decode(flush=True)

    def _cut_at_stop(self) -> bool:
        if not self._stop:
            return False
        start = max(0, self._searched - self._hold)
        found = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        self._searched = len(self.text)
        if found:
            self.text = self.text[:min(found)]
        return bool(found)

    def take(self, final: bool) -> str:
        """The text not handed out yet, less what is held back unless final."""
        end = len(self.text) if final else max(self._sent, len(self.text) - self._hold)
        out, self._sent = self.text[self._sent:end], end
        return out


class _Request:
    def __init__(self, seq: Sequence, text: TextStream | None, loop: asyncio.AbstractEventLoop) -> None:
        self.seq = seq
        self.text = text
        self.loop = loop
        self.queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()


class RequestStream:
    """One request's deltas, as an async iterator ending with the delta that has a finish_reason.
    Deltas that piled up while the reader was busy come merged into one. abort() (or leaving
    early through `async with`) ends the request and frees its KV blocks at the next step."""

    def __init__(self, engine: "AsyncLLM", request: _Request) -> None:
        self._engine = engine
        self._request = request
        self.num_prompt_tokens = request.seq.num_prompt_tokens
        self.done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestDelta:
        if self.done:
            raise StopAsyncIteration
        queue = self._request.queue
        items = [await queue.get()]
        while not queue.empty() and not isinstance(items[-1], BaseException) and items[-1].finish_reason is None:
            items.append(queue.get_nowait())
        if isinstance(items[-1], BaseException):
            self.done = True
            raise EngineDead("the engine stopped") from items[-1]
        delta = items[0] if len(items) == 1 else RequestDelta(
            "".join(d.text for d in items), tuple(t for d in items for t in d.token_ids), items[-1].finish_reason)
        self.done = delta.finish_reason is not None
        return delta

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self._engine._command("abort", self._request)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


class AsyncLLM:
    """Serves one LLM to asyncio callers: `submit` a request, read its RequestStream.

    At most llm's max_num_seqs + max_waiting requests are unfinished at once; `submit` raises
    EngineBusy past that. on_finish, if given, is called on the engine thread with each request's
    Sequence when it finishes or is aborted (its token times, lengths and finish reason are final)."""

    def __init__(self, llm: LLM, max_waiting: int = DEFAULT_MAX_WAITING,
                 on_finish: Callable[[Sequence], None] | None = None) -> None:
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an int >= 0, got {max_waiting!r}")
        self.llm = llm
        # The engine thread's current device must be the engine's: a bare "cuda" means the caller's current one.
        device = llm.device
        self._cuda_index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        self.max_unfinished = llm.engine_config.max_num_seqs + max_waiting
        self._on_finish = on_finish
        self._cond = threading.Condition()
        self._commands: list[tuple[str, _Request]] = []  # under _cond
        self._num_unfinished = 0  # under _cond
        self._closing = False  # under _cond
        self._submit_lock = threading.Lock()  # make_sequence numbers sequences: one caller at a time
        self._requests: dict[int, _Request] = {}  # the engine thread's own: seq_id -> request
        self._stats = self._read_stats()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="fuselab-engine", daemon=True)

    def start(self) -> "AsyncLLM":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the engine thread; unfinished requests end with finish_reason "abort"."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stats(self) -> EngineStats:
        """Scheduler and KV-cache counts as of the latest step."""
        return self._stats

    def submit(self, prompt: str | list[int], params: SamplingParams, stop: SequenceType[str] = (),
               name: str = "prompt") -> RequestStream:
        """Check and queue one request; call from a running event loop. Bad prompts or
        parameters raise ValueError or TypeError here (naming the prompt `name`), a full engine
        EngineBusy, a stopped one EngineDead: nothing is queued then."""
        loop = asyncio.get_running_loop()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        tokenizer = self.llm.tokenizer
        if stop and tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer.json, which this checkpoint lacks; "
                             "use stop token ids")
        with self._submit_lock:
            seq = self.llm.make_sequence(prompt, params, name)
        request = _Request(seq, None if tokenizer is None else TextStream(tokenizer, stop), loop)
        with self._cond:
            if self._closing or not self.alive:
                failure = f": it failed with {self.error!r}" if self.error else ""
                raise EngineDead(f"the engine is not running{failure}")
            if self._num_unfinished >= self.max_unfinished:
                raise EngineBusy(f"{self._num_unfinished} requests are unfinished, as many as this server accepts "
                                 "(max_num_seqs + max_waiting): try again later")
            self._num_unfinished += 1
            self._commands.append(("add", request))
            self._cond.notify()
        return RequestStream(self, request)

    def _command(self, kind: str, request: _Request) -> None:
        with self._cond:
            self._commands.append((kind, request))
            self._cond.notify()

    # ---------------------------------------------------------------------------------------
    # The engine thread
    # ---------------------------------------------------------------------------------------

    def _loop(self) -> None:
        scheduler = self.llm.scheduler
        try:
            if self._cuda_index is not None:
                torch.cuda.set_device(self._cuda_index)  # the current device is per thread; events record on it
            while True:
                with self._cond:
                    while not (self._commands or self._closing or scheduler.has_unfinished()):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    if self._closing:
                        break
                self._apply(commands)
                outputs = self._outputs(self.llm.step()) if scheduler.has_unfinished() else []
                self._stats = self._read_stats()  # before the outputs: a reader of them sees counts as new
                self._deliver(outputs)
        except BaseException as err:
            self.error = err  # every unfinished request hears of it
            raise
        finally:
            self._end_all()

    def _apply(self, commands: list[tuple[str, _Request]]) -> None:
        for kind, request in commands:
            seq = request.seq
            if kind == "add":
                self._requests[seq.seq_id] = request
                self.llm.scheduler.add(seq)
            elif seq.seq_id in self._requests:  # an abort of a request not yet finished
                self.llm.scheduler.abort([seq])
                self._finished(request)

    def _outputs(self, tokens: list[tuple[Sequence, int]]) -> list[tuple[_Request, RequestDelta]]:
        out = []
        for seq, token in tokens:
            request = self._requests[seq.seq_id]
            reason = seq.finish_reason
            text = ""
            if request.text is not None:
                # A stop token's own text is left out, as a stop string is.
                hit_stop = reason != "stop" and request.text.add(token)
                if reason is not None and not hit_stop:
                    hit_stop = request.text.finish()
                if hit_stop:
                    if seq.status is not SequenceStatus.FINISHED:
                        self.llm.scheduler.abort([seq], reason="stop")
                    reason = "stop"
                text = request.text.take(final=reason is not None)
            out.append((request, RequestDelta(text, (token,), reason)))
            if reason is not None:
                self._finished(request)
        return out

    def _finished(self, request: _Request) -> None:
        del self._requests[request.seq.seq_id]
        with self._cond:
            self._num_unfinished -= 1
        if self._on_finish is not None:
            self._on_finish(request.seq)

    def _deliver(self, items: list[tuple[_Request, RequestDelta | BaseException]]) -> None:
        """Hand each step's outputs to their event loops: one wake-up per loop, not per token."""
        by_loop = defaultdict(list)
        for request, item in items:
            by_loop[request.loop].append((request, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's event loop is closed: nobody is left to read
                for request in {id(r): r for r, _ in batch if r.seq.seq_id in self._requests}.values():
                    self.llm.scheduler.abort([request.seq])
                    self._finished(request)

    def _end_all(self) -> None:
        """On close or error: drop what is left; readers get an "abort" delta (or the error)."""
        with self._cond:
            self._closing = True
            commands, self._commands = self._commands, []
        for kind, request in commands:
            if kind == "add":
                self._requests[request.seq.seq_id] = request
        remaining = list(self._requests.values())
        self.llm.scheduler.abort([r.seq for r in remaining])
        for request in remaining:
            self._finished(request)
        self._stats = self._read_stats()
        self._deliver([(r, self.error or RequestDelta("", (), "abort")) for r in remaining])

    def _read_stats(self) -> EngineStats:
        scheduler = self.llm.scheduler
        return EngineStats(len(scheduler.running), len(scheduler.waiting), self.llm.num_kv_blocks,
                           scheduler.block_manager.num_free_blocks, scheduler.num_preemptions)


def _put_all(batch: list[tuple[_Request, RequestDelta | BaseException]]) -> None:
    for request, item in batch:
        request.queue.put_nowait(item)
