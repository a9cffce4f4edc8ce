"""Serve a Qwen2/Qwen3 model over an OpenAI-compatible HTTP API.

    python serve.py --model Qwen/Qwen3-0.6B --port 8000

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses,
POST /v1/embeddings, GET /v1/models, GET /health, GET /metrics (Prometheus), and GET / (a
chat page). Ctrl-C (SIGINT) or SIGTERM stops it
within seconds: requests in flight are aborted and answered before the process exits.
"""

import logging
import os
import resource
import signal
import threading
import time
from typing import Any

import click

from nanoqwen.cli import (
    config_option,
    describe_engine,
    engine_options,
    in_flags,
    model_option,
    pop_engine_options,
    quiet_library_noise,
)
from nanoqwen.server import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_QUEUE,
    GRAMMAR_COMPILE_BYTES,
    GRAMMAR_COMPILE_SECONDS,
    WRITE_TIMEOUT_SECONDS,
    make_server,
)

logger = logging.getLogger("nanoqwen.serve")


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@config_option
@model_option(required=True)
@click.option("--host", default="127.0.0.1", help="Interface to bind; 0.0.0.0 exposes the server.")
@click.option("--port", default=8000, type=click.IntRange(0, 65535), help="0 picks a free port.")
@click.option(
    "--api-key", envvar="NANOQWEN_API_KEY", default=None,
    help="Require 'Authorization: Bearer KEY' on every route but /health and the chat page "
    "(also read from NANOQWEN_API_KEY).",
)
@click.option(
    "--max-queue", default=DEFAULT_MAX_QUEUE, type=click.IntRange(min=0),
    help="Sequences that may wait beyond --max-num-seqs; more get 429 with Retry-After.",
)
@click.option(
    "--request-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
    help="Seconds after which an unfinished request is aborted (504). Default: no limit.",
)
@click.option(
    "--write-timeout", type=click.FloatRange(min=0, min_open=True),
    default=WRITE_TIMEOUT_SECONDS, metavar="SECONDS",
    help="A client that reads nothing of its answer for this long has its request aborted.",
)
@click.option(
    "--max-connections", default=DEFAULT_MAX_CONNECTIONS, type=click.IntRange(min=1),
    help="Connections served at once; more get 503.",
)
@click.option(
    "--allowed-origins", multiple=True, metavar="ORIGIN",
    help="Web origin (e.g. http://localhost:3000) whose pages may call the API; '*' allows "
    "any. Repeatable. Default: only the server's own page.",
)
@click.option(
    "--grammar-compile-timeout", type=click.FloatRange(min=0, min_open=True),
    default=GRAMMAR_COMPILE_SECONDS, metavar="SECONDS",
    help="A request's grammar (JSON schema, regex, forced tool call) that takes longer to "
    "compile is refused (400).",
)
@click.option(
    "--grammar-compile-memory", type=click.IntRange(min=1), default=GRAMMAR_COMPILE_BYTES >> 20,
    metavar="MIB", help="A request's grammar that needs more memory to compile is refused (400).",
)
@click.option(
    "--served-model-name", default=None,
    help="Model id in the API. Default: the checkpoint's directory name, a GGUF file's "
    "name without .gguf, or the hub id.",
)
@engine_options
def main(
    model: str, host: str, port: int, api_key: str | None, max_queue: int,
    request_timeout: float | None, write_timeout: float, max_connections: int,
    allowed_origins: tuple[str, ...], grammar_compile_timeout: float,
    grammar_compile_memory: int, served_model_name: str | None, **options: Any,
) -> None:
    """Serve a Qwen2/Qwen3 checkpoint over an OpenAI-compatible HTTP API."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    quiet_library_noise()
    allow_file_descriptors(max_connections)
    started = time.perf_counter()
    try:
        server = make_server(
            model, host, port, served_model_name=served_model_name, api_key=api_key,
            max_queue=max_queue, request_timeout=request_timeout, write_timeout=write_timeout,
            max_connections=max_connections, allowed_origins=allowed_origins,
            grammar_compile_timeout=grammar_compile_timeout,
            grammar_compile_memory=grammar_compile_memory << 20,
            **pop_engine_options(options),
        )
    except ValueError as error:  # a setting the engine refuses, or a port in use
        raise click.ClickException(in_flags(str(error))) from None
    logger.info(
        "loaded in %.1f s: %s", time.perf_counter() - started, describe_engine(server.engine)
    )
    bound_host, bound_port = server.server_address[:2]
    logger.info(
        "serving %s as model %r on http://%s:%d (Ctrl-C stops)",
        model, server.settings.model_name, bound_host, bound_port,
    )

    # serve_forever runs in a thread so the main thread is free to catch the signal and
    # call shutdown(), which waits for serve_forever to return.
    stop = threading.Event()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, lambda *_: stop.set())
    serving = threading.Thread(target=server.serve_forever, name="nanoqwen-http")
    serving.start()
    # A signal may land on any thread (an OpenMP worker's, say); Python then runs its handler
    # only when the main thread next runs bytecode, which an untimed wait would never do.
    while not stop.wait(timeout=0.25):
        pass
    logger.info("stopping: aborting requests in flight")
    server.shutdown()
    server.server_close()
    serving.join()
    logger.info("stopped")
    logging.shutdown()
    # Everything is answered and closed. The interpreter's own exit would still wait for
    # a grammar compiling in native code (xgrammar's, which nothing can interrupt).
    os._exit(0)


def allow_file_descriptors(max_connections: int) -> None:
    """Raise this process's soft limit on open files so every connection can have one."""
    wanted = max_connections + 256  # and room for the model's files, logs, the listener
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        if limit < wanted:
            logger.warning("only %d open files allowed; lower --max-connections to %d",
                           limit, max(1, limit - 256))


if __name__ == "__main__":
    main()
