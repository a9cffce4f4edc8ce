"""An OpenAI-compatible HTTP server: many client threads, one engine thread.

Read it in this order:

* `engine_loop` — the idea: `EngineLoop` lets one thread per connection share one
  `LLMEngine`, through a command queue in and a queue of outputs per request back out.
* `protocol` and `responses` — the OpenAI API: what a request may say (checked, with
  errors that name the field) and what the answers look like, whole or streamed.
  `fields` says which fields each route takes (the rest: a 400 or a logged warning);
  `logprobs`, `structured` and `tools` (with `schemas`) are the parts of a request that
  ask for log-probabilities, a grammar or tool calls, each with its own corner of the
  answer; `tokens` shapes the routes beside generation (embeddings, tokenize, model
  cards); `responses_input` and `responses_output` are the Responses API, the same chat
  turn in OpenAI's newer shapes.
* `tokenizing` — prompts and conversations into token ids, each request's size bounded
  before the tokenizer runs.
* `routes` — the endpoints; `generation` — the flow of one request from its queue slots
  to its last event.
* `plumbing`, `headers`, `sockets` and `app` — the `http.server` parts: deadlines,
  disconnects, strict headers, who may call, Server-Sent Events, the connection cap and a
  shutdown that never waits on a client; `settings` holds the server's limits, `page`
  serves the chat page's files.

`make_server(model, host, port, **options)` takes the port, loads a model and returns
the bound `OpenAIServer`; `serve.py` is its command line.
"""

from nanoqwen.server.app import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_QUEUE,
    GRAMMAR_COMPILE_BYTES,
    GRAMMAR_COMPILE_SECONDS,
    WRITE_TIMEOUT_SECONDS,
    OpenAIServer,
    ServerSettings,
    make_server,
)

__all__ = [
    "DEFAULT_MAX_CONNECTIONS", "DEFAULT_MAX_QUEUE", "GRAMMAR_COMPILE_BYTES",
    "GRAMMAR_COMPILE_SECONDS", "WRITE_TIMEOUT_SECONDS", "OpenAIServer", "ServerSettings",
    "make_server",
]
