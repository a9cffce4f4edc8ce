"""Serve a Qwen2/Qwen3 model over an OpenAI-compatible HTTP API.

    python serve.py --model Qwen/Qwen3-0.6B --port 8000

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus), and GET / (a chat page). Ctrl-C (SIGINT) or SIGTERM stops it
cleanly: requests in flight are aborted and answered before the process exits.
"""

import dataclasses
import logging
import signal
import threading
from typing import Any

import click

from nanoqwen.config import DTYPES, EngineConfig
from nanoqwen.server import DEFAULT_MAX_QUEUE, make_server

logger = logging.getLogger("nanoqwen.serve")


def engine_default(name: str) -> Any:
    """The engine's own default for an option, so --help shows it without repeating it."""
    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == name)


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--model", required=True, help="Hugging Face hub id or local checkpoint directory.")
@click.option("--host", default="127.0.0.1", help="Interface to bind; 0.0.0.0 exposes the server.")
@click.option("--port", default=8000, type=click.IntRange(0, 65535), help="0 picks a free port.")
@click.option(
    "--api-key", envvar="NANOQWEN_API_KEY", default=None,
    help="Require 'Authorization: Bearer KEY' on /v1/* routes (also read from NANOQWEN_API_KEY).",
)
@click.option(
    "--max-queue", default=DEFAULT_MAX_QUEUE, type=click.IntRange(min=0),
    help="Sequences that may wait beyond --max-num-seqs; more get 429 with Retry-After.",
)
@click.option(
    "--request-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
    help="Seconds after which an unfinished request is aborted (504). Default: no limit.",
)
@click.option("--served-model-name", default=None, help="Model name in the API. Default: --model.")
@click.option("--device", default=None, help="cpu or cuda. Default: cuda when available.")
@click.option("--dtype", default=None, type=click.Choice(sorted(DTYPES)),
              help="Weights and KV-cache dtype. Default: bfloat16 on CUDA, float32 on CPU.")
@click.option("--max-num-seqs", default=engine_default("max_num_seqs"), type=click.IntRange(min=1),
              help="Most sequences in one batch.")
@click.option("--max-model-len", default=None, type=click.IntRange(min=1),
              help="Longest sequence, prompt plus output. Default: the model's.")
@click.option("--page-size", default=engine_default("page_size"), type=click.IntRange(min=1),
              help="Tokens per KV-cache page.")
@click.option("--kv-cache-memory", default=None, type=click.FloatRange(min=0, min_open=True),
              help="KV-cache size: bytes, or a fraction (<= 1) of free GPU memory.")
@click.option("--num-pages", default=None, type=click.IntRange(min=1),
              help="KV-cache size in pages (overrides --kv-cache-memory).")
@click.option("--chunk-size", default=None, type=click.IntRange(min=1),
              help="Most prompt tokens prefilled per step. Default: 8192 on CUDA, 512 on CPU.")
@click.option("--prefix-cache/--no-prefix-cache", "enable_prefix_cache",
              default=engine_default("enable_prefix_cache"),
              help="Reuse the KV of prompt prefixes seen before.")
@click.option("--enforce-eager", is_flag=True, default=engine_default("enforce_eager"),
              help="Run every step eagerly (no CUDA graphs).")
def main(
    model: str, host: str, port: int, api_key: str | None, max_queue: int,
    request_timeout: float | None, served_model_name: str | None, kv_cache_memory: float | None,
    **engine_options: Any,
) -> None:
    """Serve a Qwen2/Qwen3 checkpoint over an OpenAI-compatible HTTP API."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if kv_cache_memory is not None and kv_cache_memory > 1:
        kv_cache_memory = int(kv_cache_memory)  # a byte count, not a fraction
    logger.info("loading %s", model)
    try:
        server = make_server(
            model, host, port, served_model_name=served_model_name, api_key=api_key,
            max_queue=max_queue, request_timeout=request_timeout,
            kv_cache_memory=kv_cache_memory, **engine_options,
        )
    except ValueError as error:  # a setting the engine or the server refuses
        raise click.ClickException(str(error)) from error
    bound_host, bound_port = server.server_address[:2]
    logger.info("serving %s on http://%s:%d (Ctrl-C stops)", model, bound_host, bound_port)

    # serve_forever runs in a thread so the main thread is free to catch the signal and
    # call shutdown(), which waits for serve_forever to return.
    stop = threading.Event()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, lambda *_: stop.set())
    serving = threading.Thread(target=server.serve_forever, name="nanoqwen-http")
    serving.start()
    stop.wait()
    logger.info("stopping: aborting requests in flight")
    server.shutdown()
    server.server_close()
    serving.join()
    logger.info("stopped")


if __name__ == "__main__":
    main()
