"""A grammar compiled first where it can be stopped: a worker process, within a budget.

The problem: xgrammar compiles in native code that no thread can interrupt, and a hostile
grammar (a JSON schema with thousands of properties, arrays nested hundreds deep)
compiles for minutes and takes gigabytes. A process can be stopped. So a server first
compiles each new grammar in a worker process (`grammar_worker.py`): the worker caps its
own memory for the compile (`RLIMIT_DATA`: an allocation past the budget fails), and this
side kills it once the budget's seconds are up, the caller gives up (its client left), or
the server stops; the next grammar starts a fresh worker. The worker answers only "it
compiled" or the error: xgrammar can write a compiled grammar out, but for a schema of 200
properties that takes ten times as long as compiling it (2.2 s against 0.2 s with Qwen's
vocabulary), so what passed is compiled again in the server (`grammar.py`), where it takes
about what it took here.

The protocol, in JSON lines: the worker says `{"ready": true}` once it has started; its
first line in is the vocabulary (xgrammar's `TokenizerInfo`, serialized); then each line
in is `{"spec": ..., "memory_bytes": n}` and each line out `{"ok": true}` or
`{"error": message}` (with `"memory": true` when the memory ran out).
Invariant: at most one worker runs, compiling at most one grammar.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from nanoqwen.sampling.structured import CompileBudget, StructuredOutput

POLL_SECONDS = 0.05  # how often a waiting caller is asked whether to go on
START_SECONDS = 300.0  # a worker that has not started by then never will
WORKER = [sys.executable, "-m", "nanoqwen.sampling.grammar_worker"]


def wait_for(ready: Callable[[], Any], check: Callable[[], None]) -> Any:
    """Call `ready` (which may wait up to `POLL_SECONDS`) until it returns something other
    than None or False, calling `check` (which may raise to give up) between the calls."""
    while True:
        result = ready()
        if result is not None and result is not False:
            return result
        check()


class Sandbox:
    """The server's handle on the worker process: `vet` one grammar at a time."""

    def __init__(self, tokenizer_info: str) -> None:
        self._tokenizer_info = tokenizer_info  # xgrammar's TokenizerInfo, serialized
        self._worker: subprocess.Popen | None = None
        self._closed = False
        self._lock = threading.Lock()  # `close` may come from another thread

    def vet(self, spec: StructuredOutput, budget: CompileBudget, check: Callable[[], None]
            ) -> None:
        """Return once `spec` compiled in the worker within `budget`;
        a ValueError if it is invalid or needs more than the budget. `check` is called
        while this waits and may raise to give up, which stops the worker."""
        try:
            worker = self._started(check)
            self._send(worker, {"spec": asdict(spec), "memory_bytes": budget.memory_bytes})
            deadline = time.monotonic() + budget.seconds
            answer = wait_for(lambda: self._answer(worker, deadline, check), check)
        except BaseException:
            self._stop()
            raise
        if "ok" in answer:
            return
        if "error" not in answer:  # past the deadline, or the worker died
            self._stop()
        where = f"structured_output.{spec.kind}"
        if answer.get("memory"):
            raise ValueError(f"{where} needs more memory to compile than this server's limit "
                             f"of {budget.memory_bytes >> 20} MiB")
        if answer.get("deadline"):
            raise ValueError(f"{where} takes longer to compile than this server's limit of "
                             f"{budget.seconds:g} s")
        if "exited" in answer:
            raise ValueError(f"{where} could not be compiled: the compiler stopped on it "
                             f"(exit status {answer['exited']})")
        raise ValueError(answer["error"])

    def close(self) -> None:
        """Stop the worker; a `vet` under way fails, and no other may start."""
        with self._lock:
            self._closed = True
        self._stop()

    def _started(self, check: Callable[[], None]) -> subprocess.Popen:
        """The worker, started and told the vocabulary if it was not already."""
        with self._lock:
            worker, closed = self._worker, self._closed
            if worker is None and not closed:
                worker = self._worker = subprocess.Popen(
                    WORKER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                )
                starting = True
            else:
                starting = False
        if closed:
            self._stopped(check)
        if starting:
            deadline = time.monotonic() + START_SECONDS
            if "ready" not in wait_for(lambda: self._answer(worker, deadline, check), check):
                raise RuntimeError("the grammar compiler's worker did not start")
            worker.stdin.write(self._tokenizer_info + "\n")
        return worker

    def _send(self, worker: subprocess.Popen, message: dict[str, Any]) -> None:
        try:
            worker.stdin.write(json.dumps(message, ensure_ascii=False) + "\n")
            worker.stdin.flush()
        except OSError:  # the worker died: its exit is read as its answer
            pass

    def _answer(self, worker: subprocess.Popen, deadline: float, check: Callable[[], None]
                ) -> dict[str, Any] | None:
        """The worker's next line; `{"exited": status}` if it died, `{"deadline": true}`
        past `deadline`, or None if nothing came within `POLL_SECONDS`."""
        poller = select.poll()
        poller.register(worker.stdout, select.POLLIN)
        if poller.poll(POLL_SECONDS * 1000):
            line = worker.stdout.readline()
            with self._lock:
                closed = self._closed
            if closed:
                self._stopped(check)
            return json.loads(line) if line else {"exited": worker.wait()}
        return {"deadline": True} if time.monotonic() > deadline else None

    def _stopped(self, check: Callable[[], None]) -> None:
        """Raise for a sandbox that was closed: the caller's check says why (its server
        stops), if it can."""
        check()
        raise RuntimeError("the grammar compiler has stopped")

    def _stop(self) -> None:
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.kill()
            worker.wait()
            for pipe in (worker.stdin, worker.stdout):
                try:
                    pipe.close()
                except OSError:  # unflushed input to a dead worker
                    pass
