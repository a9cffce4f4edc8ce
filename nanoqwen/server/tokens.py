"""The routes beside generation, in the shapes OpenAI and vLLM give them.

* `POST /v1/embeddings` (OpenAI): each input's embedding (`sampling/pooling.py`: the last
  token's final hidden state, unit length), as a list of floats or, with
  `encoding_format: "base64"` (what the `openai` client asks for), little-endian float32
  bytes in base64.
* `POST /tokenize` (vLLM): a `prompt`, or chat `messages` rendered as the chat route
  would render them, to token ids (and with `return_token_strs`, each token's text).
* `POST /detokenize` (vLLM): token ids back to text.
* `GET /v1/models/{id}` (OpenAI): one model's card; `GET /version` (vLLM).
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from nanoqwen.engine import LLMEngine
from nanoqwen.outputs import RequestOutput
from nanoqwen.server.protocol import bad_request

ENCODING_FORMATS = ("float", "base64")


def model_card(model_id: str, created: int, engine: LLMEngine) -> dict[str, Any]:
    return {
        "id": model_id, "object": "model", "created": created, "owned_by": "nanoqwen",
        "root": engine.config.model, "parent": None,
        "max_model_len": engine.max_model_len,
        # What a request that leaves these out samples with (the chat page shows them).
        "sampling_defaults": engine.sampling_defaults,
    }


def parse_encoding_format(body: dict[str, Any]) -> str:
    encoding = body.get("encoding_format")
    if encoding is None:  # left out, or null as any field may be: OpenAI's default
        return "float"
    if not isinstance(encoding, str) or encoding not in ENCODING_FORMATS:
        raise bad_request(f"encoding_format must be float or base64, got {encoding!r}",
                          "encoding_format")
    return encoding


def embeddings_response(
    outputs: list[RequestOutput], encoding: str, model_id: str, request_id: str
) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": index, "embedding": _encode(output.embedding, encoding)}
        for index, output in enumerate(outputs)
    ]
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"id": request_id, "object": "list", "created": int(time.time()), "data": data,
            "model": model_id,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def tokenize_response(
    engine: LLMEngine, token_ids: list[int], body: dict[str, Any]
) -> dict[str, Any]:
    with_strings = body.get("return_token_strs", False)
    if not isinstance(with_strings, bool):
        raise bad_request("return_token_strs must be a boolean", "return_token_strs")
    strings = [engine.tokenizer.token_text(token_id) for token_id in token_ids]
    return {"count": len(token_ids), "max_model_len": engine.max_model_len, "tokens": token_ids,
            "token_strs": strings if with_strings else None}


def parse_detokenize(body: dict[str, Any], vocab_size: int) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        type(token) is int and 0 <= token < vocab_size for token in tokens
    ):
        raise bad_request(f"tokens must be a list of token ids below {vocab_size}", "tokens")
    return tokens
