"""The grammar sandbox's worker process: compile what it is sent, within a memory budget.

Started as `python -m nanoqwen.sampling.grammar_worker` by `grammar_sandbox.Sandbox`,
which reads its answers and kills it past a compile's time budget; the protocol is
described there. Memory is capped here, per compile, by `RLIMIT_DATA` (the process's
heap and private mappings): set to what the worker holds plus the budget before each
compile, lifted after, so an allocation past the budget fails (xgrammar raises
`std::bad_alloc`) and is answered as such. A worker whose server is gone exits.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import xgrammar

from nanoqwen.sampling.grammar import compile_spec, make_compiler
from nanoqwen.sampling.structured import StructuredOutput

MAX_MESSAGE_CHARS = 2000  # an error quotes the grammar: keep the answer a short line


def main() -> None:
    threading.Thread(target=exit_with, args=(os.getppid(),), daemon=True).start()
    reply({"ready": True})
    compiler = make_compiler(xgrammar.TokenizerInfo.deserialize_json(sys.stdin.readline()))
    for line in sys.stdin:
        request = json.loads(line)
        reply(vet(compiler, StructuredOutput(**request["spec"]), request["memory_bytes"]))


def vet(compiler: xgrammar.GrammarCompiler, spec: StructuredOutput, memory_bytes: int
        ) -> dict[str, Any]:
    """Compile `spec` with at most `memory_bytes` more memory: what to answer."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
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
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (hard, hard))


def data_bytes() -> int:
    """What `RLIMIT_DATA` counts of this process now (its `VmData`)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmData:\s+(\d+) kB", status).group(1)) << 10


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def exit_with(parent: int) -> None:
    """End this process once its parent has gone (it is then some other's child)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


if __name__ == "__main__":
    main()
