"""The grammar sandbox's worker process: compile what it is sent, each grammar in a child.

Started as `python -m nanoqwen.sampling.grammar_worker` by `grammar_sandbox.Sandbox`
(the protocol is described there). Starting Python with xgrammar takes seconds, so the
worker starts once, reads the vocabulary once, and forks a child for each grammar: the
child has it all at once, compiles, answers through a pipe and exits. A compile that must
stop (past its time, its client gone: the server sends a line) is stopped by killing the
child, which costs the worker nothing; and whatever memory a compile took leaves with
its child.

Memory is capped in the child by `RLIMIT_DATA` (the process's heap and private
mappings), set to what it holds plus the budget, so an allocation past the budget fails
(xgrammar raises `std::bad_alloc`) and is answered as such. The worker is one thread,
so forking it is safe. When its server is gone (its input closes), the worker stops the
compile under way and exits.
"""

from __future__ import annotations

import json
import os
import re
import resource
import select
import signal
import sys
from pathlib import Path
from typing import Any

import xgrammar

from nanoqwen.sampling.grammar import compile_spec, make_compiler
from nanoqwen.sampling.structured import StructuredOutput

MAX_MESSAGE_CHARS = 2000  # an error quotes the grammar: keep the answer a short line


def main() -> None:
    reply({"ready": True})
    # One thread: a pool's threads would not survive the fork into the child.
    compiler = make_compiler(xgrammar.TokenizerInfo.deserialize_json(sys.stdin.readline()), 1)
    while line := sys.stdin.readline():
        request = json.loads(line)
        reply(compile_in_child(compiler, StructuredOutput(**request["spec"]),
                               request["memory_bytes"]))


def compile_in_child(compiler: xgrammar.GrammarCompiler, spec: StructuredOutput,
                     memory_bytes: int) -> dict[str, Any]:
    """Fork a child to compile `spec`; what the child answered, or how it exited."""
    answers, answer_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:  # whatever happens, the child never returns into the worker's loop
            os.close(answers)
            os.write(answer_end, json.dumps(vet(compiler, spec, memory_bytes)).encode())
        finally:
            os._exit(0)
    os.close(answer_end)
    if sys.stdin in select.select([answers, sys.stdin], [], [])[0]:
        # The server cancels (a line) or is gone (the end of the input).
        os.kill(child, signal.SIGKILL)  # not reaped yet: the pid is still the child's
        if not sys.stdin.readline():
            sys.exit(0)
    with os.fdopen(answers, "rb") as pipe:
        answer = pipe.read()
    status = os.waitpid(child, 0)[1]
    return json.loads(answer) if answer else {"exited": os.waitstatus_to_exitcode(status)}


def vet(compiler: xgrammar.GrammarCompiler, spec: StructuredOutput, memory_bytes: int
        ) -> dict[str, Any]:
    """Compile `spec` with at most `memory_bytes` more memory (in the child): the answer."""
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    limit = data_bytes() + memory_bytes
    resource.setrlimit(resource.RLIMIT_DATA,
                       (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        compile_spec(compiler, spec)
        return {"ok": True}
    except MemoryError:
        return {"error": "out of memory", "memory": True}
    except ValueError as error:
        cause = error.__cause__
        ran_out = isinstance(cause, MemoryError) or "bad_alloc" in str(cause)
        return {"error": str(error)[:MAX_MESSAGE_CHARS], "memory": ran_out}


def data_bytes() -> int:
    """What `RLIMIT_DATA` counts of this process now (its `VmData`)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmData:\s+(\d+) kB", status).group(1)) << 10


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
