"""The server's settings: who may call, how much may wait, and how long anything may take."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_CONNECTIONS = 1024
MAX_BODY_BYTES = 4 << 20  # a full context of token ids, as JSON, fits easily
READ_TIMEOUT_SECONDS = 10.0
# A client that takes nothing from a full send buffer this long is gone: its request is
# aborted. TCP moves data within a second on any working link, even a slow one.
WRITE_TIMEOUT_SECONDS = 5.0
# What compiling one request's grammar may cost (`sampling/grammar_sandbox.py`). Schemas
# people write compile in well under a second; the hostile ones, in minutes and gigabytes.
GRAMMAR_COMPILE_SECONDS = 10.0
GRAMMAR_COMPILE_BYTES = 512 << 20


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # what /v1/models lists, responses echo, and requests must name
    api_key: str | None = None  # when set: "Authorization: Bearer <key>" (but /health, the page)
    max_queue: int = DEFAULT_MAX_QUEUE  # sequences that may wait beyond max_num_seqs
    request_timeout: float | None = None  # seconds before an unfinished request is aborted
    max_body_bytes: int = MAX_BODY_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    read_timeout: float = READ_TIMEOUT_SECONDS  # to receive a request's headers and body
    write_timeout: float = WRITE_TIMEOUT_SECONDS  # for a client to make room for more answer
    allowed_origins: tuple[str, ...] = ()  # web origins besides the server's own; "*": any
    grammar_compile_timeout: float = GRAMMAR_COMPILE_SECONDS  # wall-clock, per grammar
    grammar_compile_memory: int = GRAMMAR_COMPILE_BYTES  # bytes, per grammar

    def __post_init__(self) -> None:
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset for no key)")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        for name in ("request_timeout", "read_timeout", "write_timeout",
                     "grammar_compile_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("max_body_bytes", "max_connections", "grammar_compile_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for origin in self.allowed_origins:
            parts = urlsplit(origin)
            if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc
                                  or parts.path or parts.query):
                raise ValueError(f"allowed_origins: {origin!r} is not an origin such as "
                                 "http://localhost:3000 (scheme, host, port; no path)")
