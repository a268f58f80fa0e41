"""WorkerGroup: one child process per tensor-parallel rank, driven by commands from the caller.

The caller never joins a collective itself: it only puts commands on each rank's queue and
waits, with a deadline, for their replies. So a rank that fails or hangs, even inside an NCCL
collective that will never complete, cannot hang the caller: a rank's exception comes back with
its traceback and fails the call (TensorParallelError, naming the rank); a rank that dies
without a word, or a reply that does not come in time, fails it too. Either way every rank is
then stopped. The ranks are daemonic children started with 'spawn' (CUDA cannot be forked);
they stop on close(), when the group is garbage-collected, when the caller exits, and of
themselves when the caller's process is gone.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import shutil
import signal
import tempfile
import time
import traceback
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing

# How long to wait for more ranks' errors after the first: a rank's failure makes its peers'
# collectives fail soon after, and the first error to arrive is usually the cause.
_ERROR_GRACE_S = 1.0
# How often a waiting caller looks at whether the ranks are alive, and a rank at whether the caller is.
_POLL_S = 0.05
_PARENT_POLL_S = 1.0
# A closed rank gets this long to finish its step and leave the process group before it is killed.
_CLOSE_WAIT_S = 5.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, died or did not answer in time; the message names the rank
    and holds its traceback where it sent one. The ranks have been stopped."""


# A rank's target: target(rank, size, commands, reply, rendezvous_file, *args), where commands()
# blocks for the next command (None: stop) and reply(obj) sends obj back to the caller.
RankTarget = Callable[..., None]


class WorkerGroup:
    """`size` processes, rank r running target(r, size, commands, reply, rendezvous_file, *args).
    rendezvous_file is a fresh path for torch.distributed's FileStore (no port to pick)."""

    def __init__(self, target: RankTarget, size: int, args: tuple = ()) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self.size = size
        self._dir = tempfile.mkdtemp(prefix="fuselab-tp-")
        rendezvous = str(Path(self._dir) / "rendezvous")
        self._replies = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(size)]
        self._buffered: list[deque] = [deque() for _ in range(size)]
        self._procs = [ctx.Process(target=_rank_main, name=f"fuselab-tp-rank-{rank}", daemon=True,
                                   args=(target, rank, size, self._commands[rank], self._replies, rendezvous, args))
                       for rank in range(size)]
        self._broken: str | None = None
        # Runs on close(), on garbage collection and at exit; it holds no reference to self.
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._commands, self._dir)
        for proc in self._procs:
            proc.start()

    def send(self, command: Any) -> None:
        """Queue `command` for every rank. It is pickled now, once: the queues' feeder threads send
        it later (so this never blocks), and must not see what the caller changes meanwhile."""
        self._check_usable()
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for q in self._commands:
            q.put(data)

    def receive(self, rank: int, timeout_s: float, what: str) -> Any:
        """The next reply of `rank`. Raises TensorParallelError if any rank fails or dies first, or
        if none comes within timeout_s; `what` names the awaited step in that message."""
        return self._receive(rank, time.monotonic() + timeout_s, timeout_s, what)

    def receive_all(self, timeout_s: float, what: str) -> list[Any]:
        """One reply from each rank, in rank order, all within timeout_s."""
        deadline = time.monotonic() + timeout_s
        return [self._receive(rank, deadline, timeout_s, what) for rank in range(self.size)]

    def close(self) -> None:
        """Stop every rank (those that do not stop within a few seconds are killed)."""
        self._finalizer()

    # ---------------------------------------------------------------------------------------

    def _receive(self, rank: int, deadline: float, timeout_s: float, what: str) -> Any:
        self._check_usable()
        while not self._buffered[rank]:
            try:
                kind, sender, payload = self._replies.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    self._fail(f"tensor-parallel rank {rank} did not answer {what} within {timeout_s:g} s (a rank "
                               "hung, or waits in a collective for one that did)")
                continue
            if kind == "error":
                self._fail_errors([(sender, payload)] + self._more_errors(self.size - 1))
            self._buffered[sender].append(payload)
        return self._buffered[rank].popleft()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise TensorParallelError(f"the tensor-parallel ranks have stopped: {self._broken}")
        if not self._finalizer.alive:
            raise TensorParallelError("the tensor-parallel ranks have stopped: the group was closed")

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self._procs):
            if proc.exitcode is not None:
                # A rank that raised exits right after sending its traceback: it may still be in the queue.
                errors = self._more_errors(self.size)
                if errors:
                    self._fail_errors(errors)
                self._fail(f"tensor-parallel rank {rank} exited with code {proc.exitcode} without an error (killed, "
                           "out of memory, or a crash in native code)")

    def _more_errors(self, limit: int) -> list[tuple[int, str]]:
        """Up to `limit` more ranks' errors, waiting _ERROR_GRACE_S at most; other replies are dropped."""
        errors = []
        end = time.monotonic() + _ERROR_GRACE_S
        while len(errors) < limit and (left := end - time.monotonic()) > 0:
            try:
                kind, sender, payload = self._replies.get(timeout=left)
            except queue.Empty:
                break
            if kind == "error":
                errors.append((sender, payload))
        return errors

    def _fail_errors(self, errors: list[tuple[int, str]]) -> None:
        (rank, text), others = errors[0], errors[1:]
        message = f"tensor-parallel rank {rank} failed:\n{text.rstrip()}"
        if others:
            last_lines = "; ".join(f"rank {r}: {t.strip().splitlines()[-1]}" for r, t in others)
            message += f"\n(then {last_lines})"
        self._fail(message)

    def _fail(self, message: str) -> None:
        self._broken = message.splitlines()[0]
        # A failed group has nothing left to finish: its ranks are killed at once, not asked to stop.
        stop = self._finalizer.detach()
        if stop is not None:
            _stop(*stop[2], wait_s=0.0)
        raise TensorParallelError(message)


def _rank_main(target: RankTarget, rank: int, size: int, commands: multiprocessing.Queue,
               replies: multiprocessing.Queue, rendezvous: str, args: tuple) -> None:
    # Ctrl-C in a terminal reaches every process of its group: it is the caller's to handle, and
    # the caller stops the ranks (a rank killed by it would only fail the caller's next step).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()

    def next_command() -> Any:
        while True:
            try:
                data = commands.get(timeout=_PARENT_POLL_S)
                return None if data is None else pickle.loads(data)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return None  # the caller is gone: nobody will ever send the next command

    try:
        target(rank, size, next_command, lambda payload: replies.put(("ok", rank, payload)), rendezvous, *args)
    except BaseException:  # noqa: BLE001 - everything, SystemExit included, is reported
        replies.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None


def _stop(procs: list, commands: list, directory: str, wait_s: float = _CLOSE_WAIT_S) -> None:
    for proc, q in zip(procs, commands):
        if proc.is_alive():
            q.put(None)
    deadline = time.monotonic() + wait_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(_CLOSE_WAIT_S)
    for q in commands:
        q.close()
        q.cancel_join_thread()  # a dead rank never reads what is left: do not wait to flush it
    shutil.rmtree(directory, ignore_errors=True)
