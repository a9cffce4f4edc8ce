"""Embeddings: a prompt's vector instead of its continuation.

An embedding request (`LLM.embed`, the server's `/v1/embeddings`) is queued, scheduled and
prefilled like any other request, chunk by chunk and with its prefix from the prefix
cache, so it shares the engine, its memory and its batches with generation. Where a
generation request would have its next token sampled, at the step that computes its
last prompt token, the runner takes that token's final hidden state instead: the
decoder's output after the final RMSNorm, the vector the lm_head would turn into the
next token's logits. The request then finishes without generating anything.

That is *last-token pooling*, which is how Qwen's embedding models (Qwen3-Embedding,
gte-Qwen2) define their embeddings: in a causal model only the last token has seen the
whole text. With `normalize` (the default, as OpenAI's embeddings are) the vector has
length 1, so a dot product of two of them is their cosine similarity. A chat model's
vector is its summary of the text for predicting what comes next: usable for rough
similarity; an embedding checkpoint's is made for retrieval.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PoolingParams:
    """Ask for a prompt's embedding (its last token's final hidden state) instead of text."""

    normalize: bool = True  # scale to unit length


class PoolingRequest(Protocol):
    pooling: PoolingParams | None
    embedding: torch.Tensor | None  # set once its last prompt token is computed


def record_embeddings(
    hidden: torch.Tensor, rows: Sequence[tuple[int, PoolingRequest]]
) -> None:
    """Give each request its row of `hidden` (final-norm outputs, `[rows, hidden_size]`),
    normalised if it asks, in float32."""
    for row, request in rows:
        vector = hidden[row].float()
        request.embedding = F.normalize(vector, dim=-1) if request.pooling.normalize else vector
