"""A grammar compiled first where it can be stopped: a worker process, within a budget.

The problem: xgrammar compiles in native code that no thread can interrupt, and a hostile
grammar (a JSON schema with thousands of properties, arrays nested hundreds deep)
compiles for minutes and takes gigabytes. A process can be stopped. So a server first
compiles each new grammar in a worker process (`grammar_worker.py`), which compiles it in
a child of its own with capped memory (`RLIMIT_DATA`: an allocation past the budget
fails); this side cancels the compile (the worker kills the child) once the budget's
seconds are up or the caller gives up (its client left, or its server stops). One
worker serves the whole process (`sandbox_for`), and exits with it. The worker answers
only "it compiled" or the error: xgrammar can write a compiled grammar out, but for a
schema of 200 properties that takes ten times as long as compiling it (2.2 s against
0.2 s with Qwen's vocabulary), so what passed is compiled again in the server
(`grammar.py`), where it takes about what it took there.

The protocol, in JSON lines: the worker says `{"ready": true}` once it has started; its
first line in is the vocabulary (xgrammar's `TokenizerInfo`, serialized); then each line
in is `{"spec": ..., "memory_bytes": n}` and each line out `{"ok": true}`, `{"error":
message}` (with `"memory": true` when the memory ran out) or `{"exited": status}` (the
child died, or was killed). A line in while a compile runs cancels it (its answer still
comes, and is dropped); the end of the input stops the worker.
Invariant: at most one worker runs per vocabulary, compiling at most one grammar.
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
# A cancelled compile's child is killed at once: a worker that has not answered by then
# is stuck, and is stopped.
CANCEL_SECONDS = 10.0
WORKER = [sys.executable, "-m", "nanoqwen.sampling.grammar_worker"]


def wait_for(ready: Callable[[], Any], check: Callable[[], None]) -> Any:
    """Call `ready` (which may wait up to `POLL_SECONDS`) until it returns something other
    than None or False, calling `check` (which may raise to give up) between the calls."""
    while True:
        result = ready()
        if result is not None and result is not False:
            return result
        check()


def sandbox_for(tokenizer_info: str) -> Sandbox:
    """The process's sandbox for a vocabulary (xgrammar's `TokenizerInfo`, serialized):
    engines with one tokenizer share its worker. A server holds one engine; notebooks and
    tests hold several, and a worker costs seconds to start."""
    with _SANDBOXES_LOCK:
        if tokenizer_info not in _SANDBOXES:
            _SANDBOXES[tokenizer_info] = Sandbox(tokenizer_info)
        return _SANDBOXES[tokenizer_info]


class Sandbox:
    """The handle on one worker process: `vet` one grammar at a time. The worker exits
    with this process (the end of its input)."""

    def __init__(self, tokenizer_info: str) -> None:
        self._tokenizer_info = tokenizer_info
        self._worker: subprocess.Popen | None = None
        self._busy = threading.Lock()  # one grammar at a time

    def vet(self, spec: StructuredOutput, budget: CompileBudget, check: Callable[[], None]
            ) -> None:
        """Return once `spec` compiled in the worker within `budget`;
        a ValueError if it is invalid or needs more than the budget. `check` is called
        while this waits and may raise to give up, which cancels the compile."""
        wait_for(lambda: self._busy.acquire(timeout=POLL_SECONDS), check)
        try:
            answer = self._compile(spec, budget, check)
        finally:
            self._busy.release()
        where = f"structured_output.{spec.kind}"
        if "ok" in answer:
            return
        if answer.get("memory"):
            raise ValueError(f"{where} needs more memory to compile than this server's limit "
                             f"of {budget.memory_bytes >> 20} MiB")
        if "deadline" in answer:
            raise ValueError(f"{where} takes longer to compile than this server's limit of "
                             f"{budget.seconds:g} s")
        if "error" not in answer:
            status = answer.get("exited", answer.get("stopped"))
            raise ValueError(f"{where} could not be compiled: the compiler stopped on it "
                             f"(exit status {status})")
        raise ValueError(answer["error"])

    def _compile(self, spec: StructuredOutput, budget: CompileBudget,
                 check: Callable[[], None]) -> dict[str, Any]:
        """The worker's answer for `spec`, or `{"deadline": true}` (compile cancelled)."""
        worker = self._started(check)
        self._send(worker, {"spec": asdict(spec), "memory_bytes": budget.memory_bytes})
        deadline = time.monotonic() + budget.seconds
        try:
            answer = wait_for(lambda: self._answer(worker, deadline), check)
        except BaseException:
            self._cancel(worker)
            raise
        if "deadline" in answer:
            self._cancel(worker)
        elif "stopped" in answer:  # the worker died: the next grammar starts another
            self._stop()
        return answer

    def _started(self, check: Callable[[], None]) -> subprocess.Popen:
        """The worker, started and told the vocabulary if it was not already."""
        if self._worker is not None:
            return self._worker
        worker = self._worker = subprocess.Popen(
            WORKER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + START_SECONDS
        try:
            if "ready" not in wait_for(lambda: self._answer(worker, deadline), check):
                raise RuntimeError("the grammar compiler's worker did not start")
        except BaseException:
            self._stop()
            raise
        self._send(worker, self._tokenizer_info)
        return worker

    def _cancel(self, worker: subprocess.Popen) -> None:
        """Have the worker kill the compile under way, and drop its answer; a worker that
        does not answer (or is gone) is stopped, and the next grammar starts another."""
        self._send(worker, {"cancel": True})
        deadline = time.monotonic() + CANCEL_SECONDS
        answer = wait_for(lambda: self._answer(worker, deadline), lambda: None)
        if "deadline" in answer or "stopped" in answer:
            self._stop()

    def _send(self, worker: subprocess.Popen, message: dict[str, Any] | str) -> None:
        line = message if isinstance(message, str) else json.dumps(message, ensure_ascii=False)
        try:
            worker.stdin.write(line + "\n")
            worker.stdin.flush()
        except OSError:  # the worker died: its exit is read as its answer
            pass

    def _answer(self, worker: subprocess.Popen, deadline: float) -> dict[str, Any] | None:
        """The worker's next line; `{"stopped": status}` if it died, `{"deadline": true}`
        past `deadline`, or None if nothing came within `POLL_SECONDS`."""
        poller = select.poll()
        poller.register(worker.stdout, select.POLLIN)
        if poller.poll(POLL_SECONDS * 1000):
            line = worker.stdout.readline()
            return json.loads(line) if line else {"stopped": worker.wait()}
        return {"deadline": True} if time.monotonic() > deadline else None

    def _stop(self) -> None:
        """Stop the worker: the end of its input makes it kill its compile and exit; a
        worker that does not is killed."""
        worker, self._worker = self._worker, None
        try:
            worker.stdin.close()
        except OSError:  # unflushed input to a dead worker
            pass
        try:
            worker.wait(timeout=CANCEL_SECONDS)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        worker.stdout.close()


_SANDBOXES: dict[str, Sandbox] = {}
_SANDBOXES_LOCK = threading.Lock()
